"""``wiola bench`` (``wiola.cli.bench``) and ``wiola.fast.speed``: pp and tg rows per weight form,
as JSON lines and as a table, run as a user runs them (``python -m wiola bench``); the bytes a step
reads against ``bench/roofline.py``'s independent count; a quantized checkpoint runs in its own
form only; bad input exits 2 with one line naming the flag; ``speed.interleaved`` alternates the
order of its runs and takes medians. No speed is asserted: only that every row was measured and is
consistent with itself."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wiola import WiolaConfig
from wiola.cli import bench as cli_bench
from wiola.cli import main
from wiola.cli.bench import TG_PROMPT
from wiola.fast import WiolaModel, decode_step_cpu, prefill, speed
from wiola.fast.quantize import matrix_bytes, quantize

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is not an installed package
    sys.path.insert(0, str(ROOT))

from terminal import run_to_exit  # noqa: E402

from bench import roofline  # noqa: E402

pytestmark = pytest.mark.usefixtures("plain_cpu")  # a plain CPU: the C++ step, not the interpreter

SMALL = WiolaConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=64)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "wiola", "bench", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "0"},
    )


@pytest.fixture(scope="module")
def step_available() -> None:
    path = decode_step_cpu.describe()
    if not path.startswith("C++"):
        pytest.skip(f"the C++ step is not available here: {path}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bench-ckpt")
    torch.manual_seed(0)
    WiolaModel(SMALL).save_pretrained(folder)
    return folder


def test_json_rows_for_every_form(step_available, checkpoint):
    done = _run("--checkpoint", str(checkpoint), "-p", "12", "-n", "5", "-r", "4", "--json")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["weights"], r["test"]) for r in rows] == [
        (form, test) for form in ("fp32", "bf16", "int8", "int4") for test in ("pp12", "tg5")
    ], rows
    cpu = decode_step_cpu.cpu_info()["name"]
    for r in rows:
        assert r["cpu"] == cpu and r["batch"] == 1 and r["reps"] == 4, r
        # the prompt mode and fp32 GEMM the pp rows ran; where this CPU's GEMM is timed on first use
        # (outside prefill.GEMM_AUTO), the times, thread count and their source are the bench process's
        here = prefill.describe()
        if "as fast as ATen" in here:
            mode, sep, gemm = r["prompt"].partition("; fp32 GEMM ")
            assert sep and mode == here.partition("; fp32 GEMM ")[0], r
            assert gemm.split(" ", 1)[0] in ("aten", "onednn"), r
            assert r["test"] != "pp12" or f"as fast as ATen on {r['threads']} thread" in gemm, r
        else:
            assert r["prompt"] == here, r
        # tg5: the timed call's 4 steps (the first token comes from the untimed prefill)
        assert r["tokens"] == (12 if r["test"] == "pp12" else 4), r
        assert r["tok_s"] > 0 and r["seconds"] > 0 and r["tok_s_stdev"] >= 0, r
        # the rate is the median time's (also of an even count of reps), as the % of a floor is
        assert r["tok_s"] == pytest.approx(r["tokens"] / r["seconds"], rel=1e-12), r
        if r["test"] == "tg5":  # 4 steps each reading the weights and the cache once at the measured rate
            assert r["read_bytes"] == r["bytes"] + speed.cache_bytes(SMALL, 1, TG_PROMPT, 5), r
            read_s = r["read_bytes"] / (r["read_floor_gbs"] * 1e9)
            assert r["pct_read_floor"] == pytest.approx(100 * 4 * read_s / r["seconds"], rel=1e-9), r
            assert r["read_floor_reader"] in speed.READERS
            # the compute floor: the step's multiply-adds at the measured in-cache rate
            compute_s = speed.step_macs(SMALL, 1) / (r["compute_floor_gmacs"] * 1e9)
            assert r["bound_by"] == (speed.BOUND_READ if read_s >= compute_s else speed.BOUND_COMPUTE), r
            assert r["pct_roofline"] == pytest.approx(100 * 4 * max(read_s, compute_s) / r["seconds"], rel=1e-9), r
            # the most of the read floor a step reaches with its multiply-adds at the measured peak
            peak_s = speed.step_macs(SMALL, 1) / (r["fma_peak_gmacs"] * 1e9)
            assert r["read_ceiling_pct"] == pytest.approx(100 * read_s / peak_s, rel=1e-9), r
        else:
            assert "pct_read_floor" not in r and "bound_by" not in r, r
        # the step's choices for this CPU, and after a tg call the threads' parts it left
        scheme = None if r["weights"] == "fp32" else r["weights"]
        assert r["tuning"] == {
            key: decode_step_cpu.choose_tuning(SMALL, scheme)[key] for key in cli_bench.TUNING_KEYS
        }, r
        assert r["tuning"]["matrix_bytes"] == matrix_bytes(SMALL, scheme), r
        assert ("balance" in r) == (r["test"] == "tg5"), r
        if "balance" in r:
            assert set(r["balance"]) == set(decode_step_cpu.BALANCE_KINDS), r
    for pp, tg in zip(rows[::2], rows[1::2]):  # a tg row: the step's own threads (one per 2 MiB, at least one)
        assert tg["threads"] == max(1, min(pp["threads"], tg["tuning"]["matrix_bytes"] // (2 << 20))), (pp, tg)
        if tg["threads"] == 1:  # no parts of its own, and none left by another form's step
            assert tg["balance"] == {kind: [] for kind in decode_step_cpu.BALANCE_KINDS}, tg
    sizes = {r["weights"]: r["bytes"] for r in rows}
    assert sizes["fp32"] > sizes["bf16"] > sizes["int8"] > sizes["int4"], sizes
    assert f"CPU: {cpu}" in done.stderr


def test_table_and_batch(step_available):
    done = _run("--preset", "tiny", "--weights", "int8", "-p", "0", "-n", "3", "-b", "2", "-r", "1", "-t", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == (
        "| model | weights | size | batch | test | t/s | % of read floor | bound by (% of it) | most at the FMA peak |"
    ), lines
    row = [line for line in lines if line.startswith("| tiny (random) | int8 |")]
    assert len(row) == 1 and re.search(r"\| (read|compute) \(\d+%\) \| \d+% \|$", row[0]), lines
    row = next(line for line in lines if line.startswith("| tiny (random)"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:5] == ["2", "tg3"] and cells[6].endswith("%"), cells
    assert "±" not in cells[5], "one run has no spread to show"
    assert "1 threads" in done.stdout and "median time of 1 run;" in done.stdout
    assert any(re.fullmatch(r"int8: [\d.]+ MB of matrices, head (streamed|cached), \d+ rows prefetched ahead, a thread per 2 MiB \(\d threads?\); threads' parts: .*", line) for line in lines), lines  # fmt: skip


def test_default_forms_leave_out_int4_where_the_widths_do_not_take_it(step_available, tmp_path):
    """Every form by default: a model whose d_model is not a multiple of int4's group runs the
    other three and says why int4 is left out; asked for by name, int4 is refused (exit 2)."""
    odd = dataclasses.replace(SMALL, d_model=40, n_heads=2, d_ff=64)
    torch.manual_seed(0)
    WiolaModel(odd).save_pretrained(tmp_path / "odd")
    done = _run("--checkpoint", str(tmp_path / "odd"), "-p", "4", "-n", "3", "-r", "1", "--json")
    assert done.returncode == 0, done.stderr
    assert sorted({json.loads(line)["weights"] for line in done.stdout.splitlines()}) == ["bf16", "fp32", "int8"]
    assert "int4 left out: int4 needs every matrix's K to be a multiple of the group size 32" in done.stderr
    refused = _run("--checkpoint", str(tmp_path / "odd"), "--weights", "int4", "-p", "4", "-n", "3", "-r", "1")
    assert refused.returncode == 2 and "multiple of the group size 32" in refused.stderr, refused.stderr


def test_pp_only_notes_say_nothing_of_tg(step_available):
    done = _run("--preset", "tiny", "--weights", "int4", "-p", "4", "-n", "0", "-r", "1")
    assert done.returncode == 0, done.stderr
    assert "tg" not in done.stdout and "int4: " in done.stdout and "threads' parts" not in done.stdout, done.stdout


@pytest.mark.parametrize("scheme", ["fp32", "bf16", "int8", "int4"])
def test_step_bytes_match_the_roofline_count(step_available, scheme):
    """The bytes a binding reads (its tensors as bound) equal ``bench/roofline.py``'s count from
    the shapes alone (matrices at their stored width, int8's row scales, int4's group scales), plus
    the helical frequencies (``rope_freqs``, D/2 floats: a buffer, not a parameter)."""
    torch.manual_seed(0)
    model = WiolaModel(SMALL).eval().requires_grad_(False)
    if scheme != "fp32":
        quantize(model, scheme)
    step = decode_step_cpu.DecodeStepCPU(model, model.new_cache(1, 4))
    want = roofline.weight_bytes(SMALL, None if scheme == "fp32" else scheme) + SMALL.head_dim // 2 * 4
    assert speed.step_bytes(step) == want, (scheme, speed.step_bytes(step), want)


def test_step_macs_match_the_bound_matrices(step_available):
    """``speed.step_macs`` (from the config alone) is the batch times every weight of the matrices
    the step multiplies by, as bound (the head once and each layer's seven projections)."""
    model = WiolaModel(SMALL).eval().requires_grad_(False)
    step = decode_step_cpu.DecodeStepCPU(model, model.new_cache(1, 4))
    weights = sum(step.step_tensors[i].numel() for i in decode_step_cpu.matrix_slots(SMALL.n_layers))
    assert speed.step_macs(SMALL, 3) == 3 * weights


@pytest.mark.parametrize("scheme", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("batch", [1, 3])
def test_product_floor_times_the_step_kernels(step_available, scheme, batch):
    """``wiola_product_reps`` computes y = x Wᵀ with the step's kernels over the head's first rows
    (the dequantized weights' products, within K·ε·Σ|w·x| of float64), each thread into its own y;
    ``product_floor`` turns its time into the step's multiply-adds at that rate."""
    from wiola.fast.quantize import dequantize

    torch.manual_seed(0)
    model = WiolaModel(SMALL).eval().requires_grad_(False)
    if scheme != "fp32":
        quantize(model, scheme)
    step = decode_step_cpu.DecodeStepCPU(model, model.new_cache(batch, 4))
    head, scale = step.step_tensors[0], step.scales[0]
    N, K, nth = 8, SMALL.d_model, 2
    x = torch.randn(batch, K, generator=torch.Generator().manual_seed(1))
    y = torch.full((nth, batch, N), float("nan"))
    rc = step.lib.wiola_product_reps(
        step.dims, head.data_ptr(), None if scale is None else scale.data_ptr(), N, K, x.data_ptr(), batch,
        y.data_ptr(), 3, nth,
    )  # fmt: skip
    assert rc == 0
    # a bf16 head is bound tiled on the amx variant (decode_step_cpu.tile_matrix): the model's own
    # row-major matrix gives the expected products
    rows, _ = model.quantized["embed.weight"] if scheme != "fp32" else (head, None)
    w = (rows.float() if scheme in ("fp32", "bf16") else dequantize(rows, scale)).double()[:N]
    want = x.double() @ w.T
    bound = K * torch.finfo(torch.float32).eps * (x.double().abs() @ w.abs().T)
    for t in range(nth):
        err = (y[t].double() - want).abs()
        where = f"{decode_step_cpu.cpu_info()['name']}, {decode_step_cpu.select_isa()}"
        assert bool((err <= bound).all()), f"{scheme} B{batch} thread {t} ({where}): {err.max()} > {bound.min()}"
    got = speed.product_floor(step, batch, repeats=2)
    assert got["threads"] == decode_step_cpu.step_threads(step.tuning) and got["macs_per_s"] > 0
    assert got["s"] == pytest.approx(speed.step_macs(SMALL, batch) / got["macs_per_s"], rel=1e-12)
    with pytest.raises(ValueError, match="batch=0 and repeats=1 must be at least 1"):
        speed.product_floor(step, 0, repeats=1)


def test_fma_peak_runs_its_chains(step_available):
    """``wiola_fma_peak`` runs C chains of ``acc = acc·a + b`` (a = 0.999999, b = 1e-7, chain c of
    thread t from c + t) ``reps`` times on each thread, each thread's sum of its chains' lanes within
    the fp32 bound of float64 (each madd at most 2ε relative, the recurrence contracting; the sum of
    C·lanes terms (C·lanes)·ε); the variant's lanes, or 0 for a chain count it has no form for.
    ``fma_peak`` turns its time into multiply-adds a second at the best chain count."""
    model = WiolaModel(SMALL).eval().requires_grad_(False)
    step = decode_step_cpu.DecodeStepCPU(model, model.new_cache(1, 4))
    lanes = {"amx": 16, "avx512": 16, "avx2": 8}.get(decode_step_cpu.select_isa(), 4)
    a, b = float(torch.tensor(0.999999, dtype=torch.float32)), float(torch.tensor(1e-7, dtype=torch.float32))
    eps = torch.finfo(torch.float32).eps
    where = f"{decode_step_cpu.cpu_info()['name']}, {decode_step_cpu.select_isa()}"
    for chains in speed.FMA_CHAINS:
        for reps in (0, 1, 5):
            out = torch.full((2,), float("nan"))
            assert step.lib.wiola_fma_peak(chains, reps, 2, out.data_ptr()) == lanes, (chains, where)
            for t in range(2):
                values = []
                for c in range(chains):
                    v = float(c + t)
                    for _ in range(reps):
                        v = v * a + b
                    values.append(v)
                want = lanes * sum(values)
                bound = (2 * reps + chains * lanes) * eps * want
                assert abs(out[t].item() - want) <= bound, f"{chains} chains, {reps} reps, thread {t} ({where})"
    assert step.lib.wiola_fma_peak(7, 1, 1, torch.empty(1).data_ptr()) == 0
    got = speed.fma_peak(step, repeats=1)
    assert got["chains"] in speed.FMA_CHAINS and got["macs_per_s"] > 0
    assert got["threads"] == decode_step_cpu.step_threads(step.tuning)
    with pytest.raises(ValueError, match="repeats=0 must be at least 1"):
        speed.fma_peak(step, repeats=0)


def test_read_ceiling_is_the_read_time_at_the_peak():
    """At 1e9 multiply-adds a second, a step of ``step_macs`` takes step_macs / 1e9 s: a read floor
    of that time allows 100%, of twice that 200%; times and rates must be positive."""
    macs = speed.step_macs(SMALL, 2)
    assert speed.read_ceiling(SMALL, 2, macs / 1e9, 1e9) == pytest.approx(100.0, rel=1e-12)
    assert speed.read_ceiling(SMALL, 2, 2 * macs / 1e9, 1e9) == pytest.approx(200.0, rel=1e-12)
    with pytest.raises(ValueError, match="must be above 0"):
        speed.read_ceiling(SMALL, 2, 0.0, 1e9)
    with pytest.raises(ValueError, match="must be above 0"):
        speed.read_ceiling(SMALL, 2, 1.0, -1.0)


@pytest.mark.parametrize(
    "read_s, compute_s, by, pct",
    [(2.0, 1.0, speed.BOUND_READ, 80.0), (1.0, 2.0, speed.BOUND_COMPUTE, 80.0), (1.0, 1.0, speed.BOUND_READ, 40.0)],
)
def test_bound_names_the_longer_floor(read_s, compute_s, by, pct):
    """4 steps in 10 s: the longer floor bounds them (a tie goes to reading), and 4 steps at it
    over 10 s is the share of it reached."""
    assert speed.bound(read_s, compute_s, 4, 10.0) == {"bound_by": by, "pct_roofline": pytest.approx(pct)}


@pytest.mark.parametrize(("batch", "prompt", "new"), [(1, 16, 5), (3, 6, 9), (2, 1, 2)])
def test_cache_bytes_count_the_slots_the_steps_attend(step_available, batch, prompt, new):
    """``speed.cache_bytes`` is the mean, over a real tg call's steps, of the keys' and values'
    bytes each step's attention reads: counted here from the cache after the call (each row's real
    slots, from ``n_real``) and the bound buffers' own shapes and widths, a step at a time."""
    model = WiolaModel(SMALL).eval().requires_grad_(False)
    ids = torch.randint(0, SMALL.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(5))
    run = speed.decoding_only(model, ids, new)
    run()
    state = {name: t for (name, _, _), t in zip(decode_step_cpu.layout.STATE, run.step.state, strict=True)}
    k, v = state["k"], state["v"]
    L, R, H, S, D = k.shape
    slot_bytes = L * H * D * (k.element_size() + v.element_size())  # one slot of one row, every layer
    end = state["n_real"].tolist()  # each row's slots after the call: the prompt and new - 1 steps
    assert end == [prompt + new - 1] * batch
    read = [batch * slots * slot_bytes for slots in range(prompt + 1, end[0] + 1)]  # step j: slots 0 … prompt + j
    assert len(read) == new - 1
    assert speed.cache_bytes(SMALL, batch, prompt, new) == sum(read) // len(read)


def test_cache_bytes_refuses_bad_sizes():
    assert speed.cache_bytes(SMALL, 2, 16, 1) == 0  # one token: no step
    with pytest.raises(ValueError, match="batch=0 must be at least 1"):
        speed.cache_bytes(SMALL, 0, 16, 5)


def test_bound_label_names_only_the_two_bounds():
    assert [speed.bound_label(b) for b in (speed.BOUND_READ, speed.BOUND_COMPUTE)] == ["read", "compute"]
    with pytest.raises(ValueError, match="bound_by='the cache'"):
        speed.bound_label("the cache")


def test_decoding_only_repeats_generate(step_available):
    """Each tg call starts again from the prefill's cache: the same tokens as ``generate``, every call."""
    torch.manual_seed(0)
    model = WiolaModel(SMALL).eval().requires_grad_(False)
    ids = torch.randint(0, SMALL.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    run = speed.decoding_only(model, ids, 7)
    want = model.generate(ids, 7, temperature=0)[:, 6:]
    assert torch.equal(run().clone(), want) and torch.equal(run(), want)


def test_pp_only_on_a_model_shorter_than_the_tg_prompt(step_available, tmp_path):
    """-n 0 runs no tg row, so a model of fewer positions than its 16-token prompt still gets its pp row."""
    torch.manual_seed(0)
    short = WiolaConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=8)
    WiolaModel(short).save_pretrained(tmp_path)
    done = _run("--checkpoint", str(tmp_path), "--weights", "fp32", "-p", "8", "-n", "0", "-r", "1", "--json")
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["test"] for line in done.stdout.splitlines()] == ["pp8"]
    done = _run("--checkpoint", str(tmp_path), "--weights", "fp32", "-p", "8", "-n", "2", "-r", "1")
    assert done.returncode == 2 and "16 + -n/--new-tokens = 18 is past the model's 8 positions" in done.stderr


def test_quantized_checkpoint_runs_in_its_own_form(step_available, tmp_path):
    torch.manual_seed(0)
    model = quantize(WiolaModel(SMALL).eval().requires_grad_(False), "int8")
    model.save_pretrained(tmp_path)
    done = _run("--checkpoint", str(tmp_path), "--weights", "fp32,int8", "-p", "4", "-n", "0", "-r", "1")
    assert done.returncode == 2 and "stored int8-quantized" in done.stderr and "Traceback" not in done.stderr
    done = _run("--checkpoint", str(tmp_path), "-p", "4", "-n", "0", "-r", "1", "--json")  # its form by default
    assert done.returncode == 0, done.stderr
    assert [(r["weights"], r["test"]) for r in map(json.loads, done.stdout.splitlines())] == [("int8", "pp4")]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--weights", "fp16"], "--weights 'fp16': want a comma-separated list of fp32, bf16, int8, int4"),
        (["--weights", "int8,int8"], "names a form twice"),
        (["-n", "1"], "-n/--new-tokens 1 decodes no step"),
        (["-p", "0", "-n", "0"], "one of them > 0"),
        (["-p", "-3"], "must be >= 0"),
        (["-b", "0"], "-b/--batch must be >= 1, got 0"),
        (["-r", "0"], "-r/--reps must be >= 1, got 0"),
        (["-t", "0"], "-t/--threads must be in [1, "),
        (["-t", "99999"], "(4 a CPU this process may run on), got 99999"),
        (["--preset", "tiny", "-p", "513"], "-p/--prompt-tokens = 513 is past the model's 512 positions"),
        (["--preset", "tiny", "-n", "497"], "16 + -n/--new-tokens = 513 is past the model's 512 positions"),
        (["--revision", "main"], "--revision 'main' applies to a Hub id --checkpoint; none was given"),
    ],
)
def test_bad_input_exits_2(args, message, capsys):
    """Checked before any model is made (in-process: ``wiola.cli.main``, the command's entry point)."""
    assert main(["bench", *args]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wiola bench: error: ") and message in lines[0], err
    assert out == ""


def test_a_model_the_step_does_not_decode_exits_2_saying_why(step_available, checkpoint):
    """With the kernels off (``WIOLA_FAST_KERNELS=off``, read when ``wiola.fast`` is imported) the
    model decodes on the PyTorch path: there is nothing to time, and one line says why (the other
    reasons: ``test_describe_cpu_decoding_names_what_keeps_the_step_off``)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "WIOLA_FAST_KERNELS": "off"}
    done = subprocess.run(
        [sys.executable, "-m", "wiola", "bench", "--checkpoint", str(checkpoint), "-p", "4", "-n", "2", "-r", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env=env,
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert lines[-1] == (
        "wiola bench: error: the C++ CPU step does not decode this model here, so there is nothing to time: "
        "PyTorch path: the model's kernels are off (WIOLA_FAST_KERNELS or use_kernels(False))"
    ), done.stderr


def test_read_floor_refuses_less_than_a_row():
    with pytest.raises(ValueError, match="nbytes=100 must be at least 1024"):
        speed.read_floor(100)
    got = speed.read_floor(1 << 16, repeats=2)
    assert got["s"] > 0 and got["reader"] in speed.READERS
    assert set(got) == {"s", "reader", *(f"{name} GB/s" for name in speed.READERS)}


class _Clock:
    """A ``time`` whose ``perf_counter`` moves only when a fake reader or kernel says it ran."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_floors_keep_the_fastest_reader_and_chain_count_and_count_every_thread(monkeypatch):
    """The arithmetic of ``read_floor``, ``product_floor`` and ``fma_peak`` on a fake clock: the
    read floor is the faster reader's time; the product rate counts every thread's multiply-adds;
    the FMA peak is the fastest chain count's rate."""
    import types

    clock = _Clock()
    monkeypatch.setattr(speed, "time", clock)
    monkeypatch.setattr(speed, "_READS", {})
    monkeypatch.setattr(speed, "_PRODUCTS", {})
    monkeypatch.setattr(speed, "_PEAKS", {})

    def reader(cost):
        def read(A, x):
            clock.now += cost

        return read

    monkeypatch.setattr(speed, "READERS", {"slow": reader(0.004), "fast": reader(0.001)})
    got = speed.read_floor(1 << 20, repeats=3)
    assert got["reader"] == "fast" and got["s"] == pytest.approx(0.001), got
    assert got["fast GB/s"] == pytest.approx((1 << 20) / 0.001 / 1e9) and got["slow GB/s"] < got["fast GB/s"]

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    config = WiolaConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=16)

    def product_reps(*args):  # (dims, w, scale, N, K, x, batch, y, reps, threads): 1 s a call
        clock.now += 1.0
        return 0

    lib = types.SimpleNamespace(_name="fake", wiola_product_reps=product_reps)
    chosen = {"matrix_bytes": 16 << 20, "bytes_per_thread": 2 << 20}  # a step of two threads (of 2)
    step = types.SimpleNamespace(
        config=config, step_tensors=[torch.zeros(64, 32)], scales=[None], dims=[1], lib=lib, tuning=chosen
    )
    got = speed.product_floor(step, 1, repeats=1)
    N, K = 64, 32  # the head's first 16 KiB of 128-byte rows: all 64
    reps = speed.PRODUCT_MACS // (N * K)
    assert got["macs_per_s"] == pytest.approx(2 * reps * N * K), f"two threads' multiply-adds in 1 s: {got}"
    assert got["s"] == pytest.approx(speed.step_macs(config, 1) / got["macs_per_s"])

    def peak(chains, reps, nth, ptr):  # 16 chains run at 2 G multiply-adds a second a thread, the rest at 1
        clock.now += reps * chains * 16 / (2e9 if chains == 16 else 1e9)
        return 16

    fake = types.SimpleNamespace(lib=types.SimpleNamespace(_name="fake", wiola_fma_peak=peak), tuning=chosen)
    got = speed.fma_peak(fake, 1)
    assert got["chains"] == 16 and got["macs_per_s"] == pytest.approx(2 * 2e9), got
    monkeypatch.setattr(speed, "_PRODUCTS", {})
    step.tuning = {"matrix_bytes": 3 << 20, "bytes_per_thread": 2 << 20}  # a small model's step: one thread
    one = speed.product_floor(step, 1, repeats=1)
    assert one["threads"] == 1 and one["macs_per_s"] == pytest.approx(reps * N * K), "not timed on the step's thread"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_in_a_terminal(step_available, checkpoint, tmp_path):
    """On a terminal: the progress bar while it runs (cleared after), then the CPU line, the table
    and its legend; exit 0. The bar is read from a recording of everything written to the terminal,
    so the test does not depend on the run lasting long enough to be seen between two looks."""
    cmd = [sys.executable, "-m", "wiola", "bench", "--checkpoint", str(checkpoint), "-p", "8", "-n", "4", "-r", "3"]
    record = tmp_path / "terminal.log"
    screen = run_to_exit(f"cd {shlex.quote(str(ROOT))} && env TRITON_INTERPRET=0 {shlex.join(cmd)}", record)
    assert "EXIT=0" in screen, screen
    assert "CPU: " in screen and "| model | weights | size | batch | test | t/s | % of read floor |" in screen, screen
    assert sum(line.startswith(f"| {checkpoint} |") for line in screen.splitlines()) == 8, screen
    written = record.read_text(errors="replace")
    frames = [f for f in re.split(r"[\r\n]", written) if "/24 [" in f]
    assert frames and "int4 pp8:" in written, f"no progress bar (8 rows x 3 timed runs) was drawn:\n{written}"
    unnamed = [f for f in frames if not re.match(r"\s*(fp32|bf16|int8|int4) (pp8|tg4):", f)]
    assert not unnamed, f"bar frames without the row they time: {unnamed}"
    assert "/24" not in screen, "the bar was left on the screen"


def test_interleaved_alternates_the_order_and_takes_medians(monkeypatch):
    calls: list[str] = []
    durations = [1.0, 2.0, 4.0, 5.0, 2.0, 8.0, 7.0, 9.0]  # the calls' in order: a b b a a b b a
    ticks = [t for i, d in enumerate(durations) for t in (10.0 * i, 10.0 * i + d)]
    clock = iter(ticks)
    monkeypatch.setattr(speed.time, "perf_counter", lambda: next(clock))
    runs = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    median = speed.interleaved(runs, 4)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"], calls
    assert median == {"a": 3.5, "b": 5.5}  # medians of 1, 5, 2, 9 and 2, 4, 8, 7 (not their means or minima)


def test_a_reader_that_goes_away_ends_it_quietly(step_available, tmp_path):
    """``wiola bench --json | head -1``: a closed pipe on stdout (here closed before the command
    writes) ends it as SIGPIPE would (141), with no traceback."""
    err = tmp_path / "stderr"
    cmd = [sys.executable, "-m", "wiola", "bench", "--preset", "tiny", "--weights", "int8", "-p", "4", "-n", "2"]
    with err.open("w") as stderr:
        child = subprocess.Popen([*cmd, "-r", "1", "--json"], stdout=subprocess.PIPE, stderr=stderr)
        child.stdout.close()  # the reader is gone before the first row is written
        code = child.wait(timeout=600)
    text = err.read_text()
    assert code == 141 and "Traceback" not in text and "BrokenPipe" not in text, (code, text)
