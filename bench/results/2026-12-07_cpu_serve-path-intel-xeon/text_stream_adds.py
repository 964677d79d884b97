"""TextStream.add over the ids of sample stories (a trained byte-level BPE and GPT-2): the mean add
and the mean of the last 64, for streams of 512, 1,024 and 4,096 tokens."""

import time

from wiola.text_stream import TextStream
from wiola.tokenizer import load_tokenizer, train_tokenizer
from wiola.train.corpus import sample_corpus

train, _ = sample_corpus(600, 10, 0)
hf = train_tokenizer(train, 8000, show_progress=False)
gp = load_tokenizer("gpt2")
text = " ".join(train)[:200000]
for name, tok in (("hf-bytelevel", hf), ("gpt2", gp)):
    ids = tok.encode(text)[:4096]
    for n in (512, 1024, 4096):
        s = TextStream(tok, ["\n\nUser:"])
        t0 = time.perf_counter()
        last = []
        for _i, t in enumerate(ids[:n]):
            a = time.perf_counter()
            s.add(t)
            last.append(time.perf_counter() - a)
        tot = time.perf_counter() - t0
        assert s.text + s.rest() == tok.decode(ids[:n])
        print(
            name,
            n,
            f"total {tot * 1e3:.1f} ms, mean {tot / n * 1e6:.0f} us, last-64 mean {sum(last[-64:]) / 64 * 1e6:.1f} us",
        )
