"""Left-padded batches decode each row as if alone; right padding leaves the loss unchanged."""

from __future__ import annotations

import torch

from wiola import WiolaConfig, WiolaModel
from wiola.ops import gate


def model_and_rows():
    torch.manual_seed(0)
    cfg = WiolaConfig(vocab_size=211, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_seq_len=128)
    model = WiolaModel(cfg).eval()
    with torch.no_grad():  # strong gates, so a wrong gate mean would show
        for layer in model.layers:
            layer.attn.gate_w1.weight.normal_(0, 1.0)
            layer.attn.gate_w2.weight.normal_(0, 1.0)
    rows = [torch.randint(0, 211, (n,)) for n in (13, 5, 9)]
    return model, rows


def left_pad(rows, pad_id=0):
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r) :] = r
        mask[i, T - len(r) :] = 1
    return ids, mask


def test_left_padded_logits_equal_rows_alone():
    model, rows = model_and_rows()
    ids, mask = left_pad(rows, pad_id=7)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        for i, r in enumerate(rows):
            alone = model(r[None]).logits[0]
            got = batch[i, ids.shape[1] - len(r) :]
            assert (got - alone).abs().max() < 1e-5, f"row {i}: padded logits differ from the row alone"


def test_left_padded_greedy_tokens_equal_rows_alone():
    model, rows = model_and_rows()
    ids, mask = left_pad(rows)
    out = model.generate(ids, 12, attention_mask=mask, temperature=0)
    for i, r in enumerate(rows):
        alone = model.generate(r[None], 12, temperature=0)[0, len(r) :]
        assert torch.equal(out[i, ids.shape[1] :], alone), f"row {i}: greedy tokens differ"


def test_gate_mean_ignores_padding_and_averaging_pads_would_differ():
    """Our gate skips padding; the published wiola13m averages pad tokens too. Show both."""
    model, rows = model_and_rows()
    ids, mask = left_pad(rows)
    layer = model.layers[0].attn
    torch.manual_seed(3)
    q = torch.randn(3, ids.shape[1], 4, 16)
    g_masked, _, _ = gate(q, layer.gate_w1.weight, layer.gate_w2.weight, layer.gate_w2.bias, attention_mask=mask)
    g_naive, _, _ = gate(q, layer.gate_w1.weight, layer.gate_w2.weight, layer.gate_w2.bias)
    i, n = 1, len(rows[1])
    start = ids.shape[1] - n
    g_alone, _, _ = gate(q[i : i + 1, start:], layer.gate_w1.weight, layer.gate_w2.weight, layer.gate_w2.bias)
    assert (g_masked[i, start:] - g_alone[0]).abs().max() < 1e-6
    assert (g_naive[i, start:] - g_alone[0]).abs().max() > 1e-2, "averaging pads should change the gate"


def test_right_padding_gives_the_loss_of_the_unpadded_rows():
    model, rows = model_and_rows()
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    padded = model(ids, attention_mask=mask, labels=ids).loss
    total, count = 0.0, 0
    for r in rows:
        logits = model(r[None]).logits[0]
        logp = torch.log_softmax(logits[:-1].double(), -1)
        total += -logp.gather(1, r[1:, None]).sum().item()
        count += len(r) - 1
    assert abs(padded.item() - total / count) < 1e-5


def test_left_padding_gives_the_loss_of_the_unpadded_rows():
    """A left-padded row's first real token is predicted from padding, which the row alone never
    does: that term is left out, so the batch's loss is the rows' alone (both classes; the fast
    model's fused loss without logits too)."""
    import wiola.fast

    model, rows = model_and_rows()
    ids, mask = left_pad(rows, pad_id=7)
    total, count = 0.0, 0
    with torch.no_grad():
        for r in rows:
            logp = torch.log_softmax(model(r[None]).logits[0, :-1].double(), -1)
            total += -logp.gather(1, r[1:, None]).sum().item()
            count += len(r) - 1
        fast = wiola.fast.WiolaModel(model.config).eval()
        fast.load_state_dict(model.state_dict())
        for m, return_logits in ((model, True), (fast, True), (fast, False)):
            loss = m(ids, attention_mask=mask, labels=ids, return_logits=return_logits).loss.item()
            assert abs(loss - total / count) < 1e-5, (type(m).__module__, return_logits, loss, total / count)
