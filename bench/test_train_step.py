"""A whole training step: forward with the loss, backward, AdamW.

- CPU: the tiny preset at B 4, T 256 (fp32), tokens/s (the smoke run uses B 1, T 32).
- CUDA: the paper's 13m preset at T 512, B 32 and 64, bf16 autocast with fp32 master weights,
  fused AdamW; tokens/s and MFU against the measured bf16 matmul peak. The measured model is
  ``wiola.fast.WiolaModel`` when it exists, with the reference eager and ``torch.compile`` of the
  reference as baselines (without ``wiola.fast`` the reference eager is measured against its
  compiled self). Goal (issue 6): at least 1.5× ``torch.compile`` of the reference and 25% MFU.
  Both shapes are the device check's headline (``-m headline``), and so is the step captured as
  one CUDA graph at B 32; there ``WIOLA_BENCH_COMPILED=0`` leaves ``torch.compile`` out, and its
  last stage measures it. On CUDA each also records its pace in a loop (``frame.loop_time``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import wiola
from bench import roofline
from bench.frame import compile_heavy, loop_time

CUDA_SHAPES = [dict(B=32, T=512), dict(B=64, T=512)]
# The device check's headline stage (``-m headline``): the 13m training step at both batch sizes,
# and the step captured as one CUDA graph at B 32 (its pace in a loop beside the eager step's).
HEADLINE_SHAPES = [pytest.param(s, marks=pytest.mark.headline) for s in CUDA_SHAPES]
LOOP_STEPS = 10  # training steps a loop_time loop runs back to back before its one sync
GRAPH_SHAPES = [pytest.param(s, marks=pytest.mark.headline) if s["B"] == 32 else s for s in CUDA_SHAPES]


def _fast_model_class() -> type | str:
    """``wiola.fast.WiolaModel``, or why it is unavailable."""
    try:
        import wiola.fast as fast

        return fast.WiolaModel
    except Exception as exc:
        return f"wiola.fast unavailable: {type(exc).__name__}: {exc}"


def make_step(model: torch.nn.Module, device: str, compiled: bool = False) -> Callable[[torch.Tensor], None]:
    """One training step of ``model`` (bf16 autocast on CUDA) with its own AdamW, on ids ``(B, T)``."""
    fused = device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=fused)
    forward = torch.compile(model) if compiled else model

    def step(ids: torch.Tensor) -> None:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = forward(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _random_ids(B: int, T: int, V: int, device: str) -> Callable[[], torch.Tensor]:
    return lambda: torch.randint(0, V, (B, T), device=device)


def _run_train_step(
    bench,
    step: Callable[[torch.Tensor], None],
    *,
    name: str,
    preset: str,
    B: int,
    T: int,
    dtype: torch.dtype,
    baselines: dict | None = None,
    notes: list[str],
    loop: bool = False,
) -> None:
    """Time ``step`` and ``baselines`` as one ``train_step`` of ``preset`` on fresh random ids
    ``(B, T)`` on the bench's device: the cost of a step in ``dtype`` and ``B·T`` tokens a call.
    With ``loop``, also ``step``'s time a step in a loop of ``LOOP_STEPS`` with one sync
    (``frame.loop_time``: the host's pace where it issues a step more slowly than the GPU runs it),
    recorded as ``info["loop_s_per_step"]``, ``info["loop_tokens_per_s"]`` and ``info["loop_steps"]``."""
    cfg = wiola.WiolaConfig.preset(preset)
    info = None
    if loop and not bench.quick:
        ids = _random_ids(B, T, cfg.vocab_size, bench.device)()
        per_step = loop_time(step, (ids,), steps=LOOP_STEPS)
        info = {"loop_s_per_step": per_step, "loop_tokens_per_s": B * T / per_step, "loop_steps": LOOP_STEPS}
    bench.run(
        step,
        op="train_step",
        mode="fwd_bwd_adamw",
        name=name,
        cost=roofline.train_step(cfg, B, T, dtype),
        shape={"preset": preset, "B": B, "T": T},
        dtype=dtype,
        inputs=_random_ids(B, T, cfg.vocab_size, bench.device),
        tokens=B * T,
        baselines=baselines,
        notes=notes,
        info=info,
    )


def test_train_step_cpu(cpu_bench) -> None:
    cfg = wiola.WiolaConfig.preset("tiny")
    B, T = (1, 32) if cpu_bench.quick else (4, 256)
    torch.manual_seed(0)
    model = wiola.WiolaModel(cfg).train()
    _run_train_step(
        cpu_bench,
        make_step(model, "cpu"),
        name="reference",
        preset="tiny",
        B=B,
        T=T,
        dtype=torch.float32,
        notes=["fp32, torch.optim.AdamW (foreach)"],
    )


@pytest.mark.parametrize("shape", HEADLINE_SHAPES, ids=lambda s: f"13m-B{s['B']}-T{s['T']}")
def test_train_step_cuda(cuda_bench, shape: dict[str, int]) -> None:
    cfg = wiola.WiolaConfig.preset("13m")
    B, T = shape["B"], shape["T"]
    torch.manual_seed(0)
    init = wiola.WiolaModel(cfg).state_dict()

    def reference(compiled: bool) -> Callable[[torch.Tensor], None]:
        m = wiola.WiolaModel(cfg).to("cuda").train()
        m.load_state_dict(init)
        return make_step(m, "cuda", compiled)

    fast_cls = _fast_model_class()
    compiled, notes = compile_heavy({"torch.compile": lambda: reference(True)})
    if isinstance(fast_cls, str):
        name, ours = "reference", reference(False)
        baselines = compiled
        notes.append(fast_cls)
    else:
        fm = fast_cls(cfg).to("cuda").train()
        fm.load_state_dict(init)
        name, ours = "wiola.fast", make_step(fm, "cuda")
        baselines = {"reference": reference(False), **compiled}
    _run_train_step(
        cuda_bench,
        ours,
        name=name,
        preset="13m",
        B=B,
        T=T,
        dtype=torch.bfloat16,
        baselines=baselines,
        notes=["bf16 autocast, fp32 master weights, fused AdamW", *notes],
        loop=True,
    )


# ------------------------------------------------------------------ wiola.fast additions (issue 6)
def make_graph_step(model: torch.nn.Module, B: int, T: int) -> Callable[[torch.Tensor], None]:
    """The whole training step of ``model`` (bf16 autocast forward with the fused loss, backward,
    fused capturable AdamW) captured once as a CUDA graph; each call copies the ids into the
    static input and replays. Only possible because ``wiola.fast`` never syncs with the host."""
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True, capturable=True
    )
    static_ids = torch.randint(0, model.config.vocab_size, (B, T), device="cuda")

    def body() -> None:
        # The autocast weight cache must be off while capturing (PyTorch's CUDA-graph notes).
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = model(static_ids, labels=static_ids).loss
        loss.backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernel compilation and autotuning stay out of the graph
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        body()

    def step(ids: torch.Tensor) -> None:
        static_ids.copy_(ids)
        graph.replay()

    return step


@pytest.mark.parametrize("shape", GRAPH_SHAPES, ids=lambda s: f"13m-B{s['B']}-T{s['T']}")
def test_train_step_cuda_graph_fast(cuda_bench, shape: dict[str, int]) -> None:
    """wiola.fast's training step as one CUDA graph, against the same model eager and torch.compile
    of the reference."""
    fast_cls = _fast_model_class()
    if isinstance(fast_cls, str):
        pytest.skip(fast_cls)
    cfg = wiola.WiolaConfig.preset("13m")
    B, T = shape["B"], shape["T"]
    torch.manual_seed(0)
    init = wiola.WiolaModel(cfg).state_dict()

    def fresh(cls: type) -> torch.nn.Module:
        m = cls(cfg).to("cuda").train()
        m.load_state_dict(init)
        return m

    compiled, notes = compile_heavy(
        {"torch.compile": lambda: make_step(fresh(wiola.WiolaModel), "cuda", compiled=True)}
    )
    _run_train_step(
        cuda_bench,
        make_graph_step(fresh(fast_cls), B, T),
        name="wiola.fast + CUDA graph",
        preset="13m",
        B=B,
        T=T,
        dtype=torch.bfloat16,
        baselines={"wiola.fast eager": make_step(fresh(fast_cls), "cuda"), **compiled},
        notes=["bf16 autocast (cache off), fp32 master weights, fused capturable AdamW, one graph per step", *notes],
        loop=True,
    )


def test_train_step_cpu_fast(cpu_bench) -> None:
    """wiola.fast's PyTorch CPU path (SDPA with the gate folded into the query) against the reference."""
    fast_cls = _fast_model_class()
    if isinstance(fast_cls, str):
        pytest.skip(fast_cls)
    from wiola.fast import use_kernels

    cfg = wiola.WiolaConfig.preset("tiny")
    B, T = (1, 32) if cpu_bench.quick else (4, 256)
    torch.manual_seed(0)
    ref = wiola.WiolaModel(cfg).train()
    fast = fast_cls(cfg).train()
    fast.load_state_dict(ref.state_dict())
    fast_step = make_step(fast, "cpu")

    def ours(ids: torch.Tensor) -> None:
        with use_kernels(False):  # the plain-CPU path, also under TRITON_INTERPRET=1
            fast_step(ids)

    _run_train_step(
        cpu_bench,
        ours,
        name="wiola.fast (CPU path)",
        preset="tiny",
        B=B,
        T=T,
        dtype=torch.float32,
        baselines={"reference": make_step(ref, "cpu")},
        notes=["fp32, torch.optim.AdamW (foreach)"],
    )
