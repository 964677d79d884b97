# bash ab.sh NEW_CHECKOUT OLD_CHECKOUT ROUNDS: adapter_generate.py alternately on the two.
here=$(cd "$(dirname "$0")" && pwd)
for i in $(seq "$3"); do
  echo "new:"; (cd "$1" && PYTHONPATH="$1" python "$here/adapter_generate.py")
  echo "old:"; (cd "$2" && PYTHONPATH="$2" python "$here/adapter_generate.py")
done
