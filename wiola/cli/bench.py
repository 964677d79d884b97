"""``wiola bench``: how fast a model decodes on this CPU in each weight form, as llama.cpp's
``llama-bench`` reports it: pp<P> (a P-token prompt, the logits of its last position) and tg<N>
(N greedy tokens after a 16-token prompt whose prefill is not timed), in tokens a second, each tg
row beside the read floor of its weights and cache (``wiola.fast.speed``), read between its timed
calls so that both see the same moments of a machine whose caches other programs share, and beside the
compute floor (the products' multiply-adds at the in-cache rate of the step's kernels): the longer
of the two names what bounds the step. The last column is the most of the read floor a step can
reach with its products' multiply-adds at the CPU's fp32 multiply-add peak (``speed.fma_peak``).

Every weight form is the same model: fp32, then ``wiola.fast.quantize``'s bf16, int8 and int4 of
it (a quantized checkpoint runs in its own form only). Before timing, each form's tg tokens are
checked against ``generate``'s for the same prompt: the timed loop is the one ``generate`` runs.
A table (markdown) or one JSON object a row (``--json``) goes to stdout; the CPU, the C++ step's
ISA variant and threads, and progress (on a terminal) go to stderr."""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from wiola.cli.arguments import add_checkpoint_arguments

FORMS = ("fp32", "bf16", "int8", "int4")
TG_PROMPT = 16  # the tg rows' prompt (llama-bench's tg has none; ours decodes after one, as bench/)


def register(sub: argparse._SubParsersAction) -> None:
    from wiola.config import PRESETS

    p = sub.add_parser(
        "bench", help="CPU decoding speed of each weight form (pp512 and tg128 tokens/s, as llama-bench reports them)"
    )
    add_checkpoint_arguments(p, help="model folder (ours or wiola13m's), a training run folder, or a Hub id")
    p.add_argument("--preset", default="13m", choices=sorted(PRESETS), help="random model when no checkpoint")
    p.add_argument(
        "--weights",
        help=f"comma-separated weight forms ({', '.join(FORMS)}; default: all the model takes, int4 only with "
        "widths that are multiples of 32, or a quantized checkpoint's own)",
    )
    p.add_argument("-p", "--prompt-tokens", type=int, default=512, help="pp: the prompt's length (0: no pp row)")
    p.add_argument("-n", "--new-tokens", type=int, default=128, help="tg: tokens decoded (0: no tg row)")
    p.add_argument("-b", "--batch", type=int, default=1, help="rows decoded together")
    p.add_argument("-r", "--reps", type=int, default=5, help="timed repetitions of each row (the median is shown)")
    p.add_argument(
        "-t", "--threads", type=int,
        help="torch's threads, at most 4 a CPU this process may run on (default: torch's own choice)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object a row instead of the table")
    p.set_defaults(func=_bench)


def _forms(spec: str | None, stored: str | None) -> list[str]:
    if spec is None:
        return [stored] if stored is not None else list(FORMS)
    forms = [f.strip() for f in spec.split(",") if f.strip()]
    unknown = [f for f in forms if f not in FORMS]
    if not forms or unknown:
        raise ValueError(f"--weights {spec!r}: want a comma-separated list of {', '.join(FORMS)}")
    if len(set(forms)) != len(forms):
        raise ValueError(f"--weights {spec!r} names a form twice")
    if stored is not None and forms != [stored]:
        raise ValueError(f"the checkpoint is stored {stored}-quantized: it runs only as --weights {stored}")
    return forms


def check(args: argparse.Namespace, max_len: int) -> None:
    """``ValueError`` naming the flag for a length, batch, repetition or thread count this run cannot use."""
    if args.prompt_tokens < 0 or args.new_tokens < 0 or (args.prompt_tokens == 0 and args.new_tokens == 0):
        raise ValueError("-p/--prompt-tokens and -n/--new-tokens must be >= 0, and one of them > 0")
    if args.new_tokens == 1:
        raise ValueError("-n/--new-tokens 1 decodes no step (the first token comes from the prompt): use 0 or >= 2")
    for flag, value in (("-b/--batch", args.batch), ("-r/--reps", args.reps)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    most = MAX_THREADS_PER_CPU * cpus
    if args.threads is not None and not 1 <= args.threads <= most:
        raise ValueError(
            f"-t/--threads must be in [1, {most}] ({MAX_THREADS_PER_CPU} a CPU this process may run on), got {args.threads}"
        )
    for what, length in (
        ("-p/--prompt-tokens", args.prompt_tokens),
        ("16 + -n/--new-tokens", TG_PROMPT + args.new_tokens if args.new_tokens else 0),  # no tg row: no check
    ):
        if length > max_len:
            raise ValueError(f"{what} = {length} is past the model's {max_len} positions")


def _timed(run: Any, reps: int, bar: Any, between: Any = None) -> list[float]:
    """``reps`` timed calls of ``run`` after one untimed; ``between()``, untimed, after each."""
    run()  # warm-up: first-touch of the buffers, the library's first call
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
        if between is not None:
            between()
        bar.update(1)
    return times


def _row(model_name: str, form: str, nbytes: int, test: str, tokens: int, times: list[float]) -> dict[str, Any]:
    """One row: ``tokens`` (those the timed calls compute) over the median time, so that the rate
    and the % of a floor (``seconds``) describe the same call; the spread is the standard
    deviation of the calls' rates (None for one call: unknown)."""
    seconds = statistics.median(times)
    rates = [tokens / t for t in times]
    return {
        "model": model_name, "weights": form, "bytes": nbytes, "test": test, "tokens": tokens,
        "tok_s": tokens / seconds, "tok_s_stdev": statistics.stdev(rates) if len(rates) > 1 else None,
        "seconds": seconds, "reps": len(times),
    }  # fmt: skip


# More threads than this a CPU only time the scheduler (and enough of them fail to start at all).
MAX_THREADS_PER_CPU = 4
# The step's choices for this CPU recorded in every row (``decode_step_cpu.choose_tuning``; the CPU
# and thread count are columns of their own).
TUNING_KEYS = ("matrix_bytes", "stream_head", "prefetch_rows", "bytes_per_thread")


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table, llama-bench's columns, the % of the read floor, what bounds
    the step (the read or the compute floor, and the % of it reached) and the most of the read
    floor its products allow at the fp32 multiply-add peak (``speed.read_ceiling``)."""
    from wiola.fast import speed

    lines = [
        "| model | weights | size | batch | test | t/s | % of read floor | bound by (% of it) | most at the FMA peak |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        pct = f"{r['pct_read_floor']:.0f}%" if "pct_read_floor" in r else "—"
        by = "—"
        if "bound_by" in r:
            by = f"{speed.bound_label(r['bound_by'])} ({r['pct_roofline']:.0f}%)"
        most = f"{r['read_ceiling_pct']:.0f}%" if "read_ceiling_pct" in r else "—"
        spread = "" if r["tok_s_stdev"] is None else f" ± {r['tok_s_stdev']:,.0f}"
        lines.append(
            f"| {r['model']} | {r['weights']} | {r['bytes'] / 1e6:.1f} MB | {r['batch']} | {r['test']} | "
            f"{r['tok_s']:,.0f}{spread} | {pct} | {by} | {most} |"
        )
    return "\n".join(lines)


def tuning_line(row: dict[str, Any]) -> str:
    """A row's recorded choices in words: the matrices' bytes the step was tuned for, whether the
    head was streamed, the prefetch distance, the bytes a thread and, for a tg row, the threads'
    parts of each kind of product."""
    t = row["tuning"]
    line = (
        f"{t['matrix_bytes'] / 1e6:.1f} MB of matrices, head {'streamed' if t['stream_head'] else 'cached'}, "
        f"{t['prefetch_rows']} rows prefetched ahead, a thread per {t['bytes_per_thread'] / (1 << 20):g} MiB"
        f" ({row['threads']} thread{'s' * (row['threads'] != 1)})"
    )
    if "balance" in row:
        parts = "; ".join(f"{kind} {[round(p, 3) for p in ps] or 'even'}" for kind, ps in row["balance"].items())
        line += f"; threads' parts: {parts}"
    return line


def _bench(args: argparse.Namespace) -> int:
    from wiola import WiolaConfig
    from wiola.checkpoint import resolve_checkpoint
    from wiola.fast import WiolaModel, decode_step_cpu, prefill, speed
    from wiola.fast import ops as fast_ops
    from wiola.fast.quantize import int4_refusal, quantize

    if args.revision is not None and not args.checkpoint:
        raise ValueError(f"--revision {args.revision!r} applies to a Hub id --checkpoint; none was given")
    if args.checkpoint:
        base = WiolaModel.from_pretrained(resolve_checkpoint(args.checkpoint, args.revision), device="cpu")
        model_name = args.checkpoint
        forms = _forms(args.weights, getattr(base, "quantization", None))
        check(args, base.config.max_seq_len)
    else:  # checked before the model is made
        config = WiolaConfig.preset(args.preset)
        forms = _forms(args.weights, None)
        check(args, config.max_seq_len)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            base = WiolaModel(config)
        model_name = f"{args.preset} (random)"
    base = base.eval().requires_grad_(False)
    stored = getattr(base, "quantization", None)
    if args.weights is None and "int4" in forms and (reason := int4_refusal(base)) is not None:
        forms.remove("int4")  # every form by default: the ones this model has (asked for by name, refused)
        print(f"int4 left out: {reason}", file=sys.stderr)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    why = fast_ops.describe_cpu_decoding(base)
    if not why.startswith("C++"):
        raise RuntimeError(f"the C++ CPU step does not decode this model here, so there is nothing to time: {why}")
    path = decode_step_cpu.describe()  # with torch's threads: each row names its own step's
    cpu = decode_step_cpu.cpu_info()
    prompt = prefill.describe()
    print(f"CPU: {cpu['name']} ({cpu['machine']}); {path}; {prompt}; torch {torch.__version__}", file=sys.stderr)

    generator = torch.Generator().manual_seed(1)
    V, B = base.config.vocab_size, args.batch
    pp_ids = torch.randint(0, V, (B, args.prompt_tokens), generator=generator) if args.prompt_tokens else None
    tg_ids = torch.randint(0, V, (B, TG_PROMPT), generator=generator)
    tests = (args.prompt_tokens > 0) + (args.new_tokens > 0)
    pp_test, tg_test = f"pp{args.prompt_tokens}", f"tg{args.new_tokens}"
    bar = _progress(len(forms) * tests * args.reps, f"{forms[0]} {pp_test if pp_ids is not None else tg_test}")
    nth = torch.get_num_threads()  # a prompt's products run on torch's threads
    rows = []
    try:
        for form in forms:
            model = base if form in ("fp32", stored) else quantize(copy.deepcopy(base), form)
            tg = speed.decoding_only(model, tg_ids, args.new_tokens) if args.new_tokens else None
            if args.new_tokens and tg is None:
                raise RuntimeError(
                    f"the C++ step does not run this model's {form} weights (wiola.fast.speed.decoding_only)"
                )
            step = tg.step if tg is not None else decode_step_cpu.DecodeStepCPU(model, model.new_cache(B, 1))
            nbytes = speed.step_bytes(step)
            choices = {key: step.tuning[key] for key in TUNING_KEYS}
            threads = decode_step_cpu.step_threads(step.tuning)  # a tg row's; a pp row runs on torch's
            first = len(rows)
            # A tg step reads its weights and the cache's keys and values (the mean over the call).
            read_bytes = nbytes + speed.cache_bytes(base.config, B, TG_PROMPT, args.new_tokens)
            if pp_ids is not None:
                bar.set_description(f"{form} {pp_test}")
                times = _timed(speed.prompt_run(model, pp_ids), args.reps, bar)
                rows.append(_row(model_name, form, nbytes, pp_test, B * args.prompt_tokens, times))
            if tg is not None:
                bar.set_description(f"{form} {tg_test}")
                want = model.generate(tg_ids, args.new_tokens, temperature=0, eos_token_id=None)[:, TG_PROMPT:]
                got = tg().clone()
                if not torch.equal(got, want):
                    first = (got != want).nonzero()[0].tolist()
                    raise RuntimeError(f"{form}: the timed loop's tokens differ from generate's first at {first}")

                # The floors' reads and products between the timed calls, so that they see the same
                # moments of a shared machine as the step; each floor is the best of them all.
                def between(n: int = read_bytes, step: Any = step) -> None:
                    speed.read_floor(n, speed.READS_BETWEEN)
                    speed.product_floor(step, B, speed.PRODUCT_BETWEEN)
                    speed.fma_peak(step, speed.PRODUCT_BETWEEN)

                times = _timed(tg, args.reps, bar, between)
                # The timed call's n - 1 steps compute n - 1 tokens a row; the first comes from the
                # untimed prefill's logits (llama-bench's tg counts one token a timed decode too).
                row = _row(model_name, form, nbytes, tg_test, B * (args.new_tokens - 1), times)
                read = speed.read_floor(read_bytes, 1)
                row["read_bytes"] = read_bytes
                row["read_floor_gbs"] = read_bytes / read["s"] / 1e9
                row["read_floor_reader"] = read["reader"]
                row["pct_read_floor"] = 100.0 * (args.new_tokens - 1) * read["s"] / row["seconds"]
                compute = speed.product_floor(step, B)
                row["compute_floor_gmacs"] = compute["macs_per_s"] / 1e9
                row.update(speed.bound(read["s"], compute["s"], args.new_tokens - 1, row["seconds"]))
                peak = speed.fma_peak(step)
                if peak is not None:
                    row["fma_peak_gmacs"] = peak["macs_per_s"] / 1e9
                    row["read_ceiling_pct"] = speed.read_ceiling(base.config, B, read["s"], peak["macs_per_s"])
                # The threads' parts the timed calls left (even, [], for a step on one thread).
                row["balance"] = decode_step_cpu.balance(threads)
                rows.append(row)
            for row in rows[first:]:
                row["tuning"] = choices
                row["threads"] = threads if row["test"] == tg_test else nth
    finally:
        bar.close()
    for r in rows:
        r.update(batch=B, cpu=cpu["name"], isa=decode_step_cpu.select_isa(), prompt=prompt)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(table(rows))
        print()
        for r in rows:
            if r["test"] == (tg_test if args.new_tokens else pp_test):  # a line a form
                print(f"{r['weights']}: {tuning_line(r)}")
        notes = [
            f"{cpu['name']}, {torch.get_num_threads()} threads"
            + (" (a decoding step: its own count, above)" if args.new_tokens else "")
            + "; t/s: the tokens over the median time of "
            f"{args.reps} run{'s' * (args.reps != 1)}"
            + (" ± the standard deviation of their rates" if args.reps > 1 else "")
        ]
        if args.new_tokens:
            notes.append(
                f"tg{args.new_tokens}: {args.new_tokens - 1} timed steps a row after a 16-token prompt, not timed, "
                "whose logits give the first token; % of read floor: the tg call's steps each reading "
                "the weights and the cache's keys and values once at the best rate this process read as many bytes "
                "between the timed calls; bound "
                "by: the longer of that read floor and the compute floor (the products' multiply-adds at the rate "
                "the step's own kernels reach on its threads on weights in each core's L1), and the % of it reached; "
                "most at the "
                "FMA peak: the most of the read floor a step can reach whose products' multiply-adds run at this "
                "CPU's fp32 multiply-add peak (chains that read no memory; every product multiplies each weight by "
                "x in fp32)"
            )
        print("\n" + "; ".join(notes))
    return 0


class _NoBar:
    def update(self, n: int) -> None: ...
    def set_description(self, text: str) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, desc: str) -> Any:
    """A tqdm bar on stderr where it is a terminal, named for its first row; otherwise nothing is drawn."""
    if not sys.stderr.isatty():
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr, leave=False)
