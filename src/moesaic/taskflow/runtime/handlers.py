"""Task handlers of the sequential executor: one function per ``task_type``.

Shape legend: n valid rows of a tile, H hidden, F expert hidden, A = 2F (SwiGLU) or F (GELU),
K top-k, e local experts.

A handler reads and writes exactly the regions of its task descriptor, restricted to the valid
rows of each slot (``_Run.segments``); the expert of a row range is its slot's, ``slot // P``.
Padding rows are never written, so they stay zero. The math is the plain torch reference:

    forward   h = x @ [w1 | w3];  a = silu(h1) * h3  (GELU: a = gelu(x @ w1));  y = a @ w2
    backward  g = w_tk * dy_t;  da = g @ w2^T;  dw2 = a^T g;
              dh1 = da * h3 * silu'(h1), dh3 = da * silu(h1)  (GELU: dh = da * gelu'(h));
              dx = dh @ [w1 | w3]^T;  [dw1 | dw3] = x^T dh;  dx_t = sum_k dx_tk;
              dw_tk = <dy_t, y_tk>
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moesaic.taskflow.tasks import Region

RETURN_LAYOUT = frozenset({"y_ret", "dx_ret"})


@dataclass(frozen=True, slots=True)
class Segment:
    """Valid rows ``[start, stop)`` of one slot."""

    start: int
    stop: int
    slot: int


def _w(run, name: str) -> torch.Tensor:
    """A flattened per-expert buffer viewed as ``[e, rows, cols]``."""
    buf = run.bufs[name]
    return buf.view(run.e, buf.shape[0] // run.e, buf.shape[1])


def _w_up(run, j: int) -> torch.Tensor:
    """``[w1 | w3]`` of local expert j ([H, A]); just w1 for GELU. Concatenated once per step
    (``run.memo``; a runtime may seed it with a copy it keeps across steps), not per tile."""
    if "w3" not in run.bufs:
        return _w(run, "w1")[j]
    up = run.memo.get("w_up")
    if up is None:  # two threads may both build it: same values, one wins
        up = run.memo["w_up"] = torch.cat([_w(run, "w1"), _w(run, "w3")], dim=2)
    return up[j]


def _row_tiles(run, t):
    """(start, stop, local expert) of each valid segment of the task's row region."""
    for seg in run.segments(t.inputs[0]):
        yield seg.start, seg.stop, seg.slot // run.P


def _expert_segments(run, t, buffer: str) -> list[tuple[int, list[Segment]]]:
    """(local expert, valid row segments over all its source slots) of a weight-gradient task."""
    ES = run.P * run.S
    js = [t.expert - run.me * run.e] if t.expert >= 0 else range(run.e)
    return [
        (j, run.segments(Region(buffer=buffer, rank=run.me, start=j * ES, stop=(j + 1) * ES)))
        for j in js
    ]


def _weight_grad(a_MX: torch.Tensor, b_MY: torch.Tensor, segs: list[Segment], out_XY) -> None:
    """``out = sum over segments of a[seg]^T b[seg]`` (zeros without a valid row), summed slot
    by slot in a fixed order: no gather of the rows into a copy."""
    if not segs:
        out_XY.zero_()
        return
    first, *rest = segs
    torch.mm(a_MX[first.start : first.stop].t(), b_MY[first.start : first.stop], out=out_XY)
    for s in rest:
        out_XY.addmm_(a_MX[s.start : s.stop].t(), b_MY[s.start : s.stop])


def _put_tokens(run, t, *, grad: bool) -> None:
    src = run.bufs[t.inputs[0].buffer]
    for r in t.outputs:
        for seg in run.segments(r):
            g = r.rank * run.e + seg.slot // run.P
            off = seg.start - seg.slot * run.S
            n = seg.stop - seg.start
            rows = src.index_select(0, run.route.tokens_E[g][off : off + n].to(src.device))
            if grad:
                w = run.route.weights_E[g][off : off + n].to(src.device, src.dtype)
                rows = rows * w.unsqueeze(1)
            run.put(t, Region(buffer=r.buffer, rank=r.rank, start=seg.start, stop=seg.stop), rows)


def put_dispatch(run, t) -> None:
    _put_tokens(run, t, grad=False)


def put_dispatch_grad(run, t) -> None:
    """Backward dispatch sends ``w_tk * dy_t``, the gradient of expert output row (t, k)."""
    _put_tokens(run, t, grad=True)


def put_combine(run, t) -> None:
    for src, dst in zip(t.inputs, t.outputs):
        for seg in run.segments(src):
            rows = run.bufs[src.buffer][seg.start : seg.stop]
            start = dst.start + seg.start - src.start
            reg = Region(buffer=dst.buffer, rank=dst.rank, start=start, stop=start + len(rows))
            run.put(t, reg, rows)


def gmm_gate_up(run, t) -> None:
    x, h = run.bufs["x_recv"], run.bufs["h"]
    for a, z, j in _row_tiles(run, t):
        torch.mm(x[a:z], _w_up(run, j), out=h[a:z])


def swiglu(run, t) -> None:
    h, act, Fh = run.bufs["h"], run.bufs["a"], run.plan.bucket.ffn
    for a, z, _ in _row_tiles(run, t):
        act[a:z] = F.silu(h[a:z, :Fh]) * h[a:z, Fh:]


def gelu(run, t) -> None:
    h, act = run.bufs["h"], run.bufs["a"]
    for a, z, _ in _row_tiles(run, t):
        act[a:z] = F.gelu(h[a:z])


def gmm_down(run, t) -> None:
    act, y, w2 = run.bufs["a"], run.bufs["y_rows"], _w(run, "w2")
    for a, z, j in _row_tiles(run, t):
        torch.mm(act[a:z], w2[j], out=y[a:z])


def _token_rows(t) -> slice:
    r = t.outputs[0]
    return slice(r.start, r.stop)


def _returned(run, buffer: str, rows: slice) -> torch.Tensor:
    """``[n, K, H]``: the returned rows of choices (t, k) of tokens ``rows``; zeros for
    choices the capacity dropped."""
    ret = run.bufs[buffer]
    ret_nKH = ret[run.route.ret_row_TK[rows].to(ret.device)]
    if run.route.dropped_TK is not None:
        ret_nKH = ret_nKH.masked_fill(run.route.dropped_TK[rows].to(ret.device).unsqueeze(-1), 0)
    return ret_nKH


def topk_combine(run, t) -> None:
    """``y_t = sum_k w_tk * y_tk`` in a fixed k order (deterministic)."""
    rows = _token_rows(t)
    y_ret = run.bufs["y_ret"]
    ret_nKH = _returned(run, "y_ret", rows)
    w_nK = run.route.weights_TK[rows].to(y_ret.device, y_ret.dtype)
    run.bufs["y_TH"][rows] = (ret_nKH * w_nK.unsqueeze(-1)).sum(dim=1)


def gmm_act_grad(run, t) -> None:
    g, da, w2 = run.bufs["g_recv"], run.bufs["da"], _w(run, "w2")
    for a, z, j in _row_tiles(run, t):
        torch.mm(g[a:z], w2[j].t(), out=da[a:z])


def gmm_w2_grad(run, t) -> None:
    act, g, dw2 = run.bufs["a"], run.bufs["g_recv"], _w(run, "dw2")
    for j, segs in _expert_segments(run, t, "a"):
        _weight_grad(act, g, segs, dw2[j])


def swiglu_grad(run, t) -> None:
    """``dh1 = da * h3 * silu'(h1)``, ``dh3 = da * silu(h1)``; one sigmoid per element:
    ``silu(x) = x s``, ``silu'(x) = s (1 + x (1 - s))`` with ``s = sigmoid(x)``."""
    da, h, dh, Fh = run.bufs["da"], run.bufs["h"], run.bufs["dh"], run.plan.bucket.ffn
    for a, z, _ in _row_tiles(run, t):
        h1, h3, g = h[a:z, :Fh], h[a:z, Fh:], da[a:z]
        s = torch.sigmoid(h1)
        silu = h1 * s
        torch.mul(g, silu, out=dh[a:z, Fh:])
        # silu'(h1) = s + silu * (1 - s)
        dsilu = silu.mul_(s.neg().add_(1)).add_(s)
        torch.mul(g * h3, dsilu, out=dh[a:z, :Fh])


def gelu_grad(run, t) -> None:
    """Exact (erf) GELU: ``gelu'(x) = Phi(x) + x * phi(x)``."""
    da, h, dh = run.bufs["da"], run.bufs["h"], run.bufs["dh"]
    for a, z, _ in _row_tiles(run, t):
        x = h[a:z]
        cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
        pdf = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        dh[a:z] = da[a:z] * (cdf + x * pdf)


def gmm_gate_grad(run, t) -> None:
    dh, dx = run.bufs["dh"], run.bufs["dx_rows"]
    for a, z, j in _row_tiles(run, t):
        torch.mm(dh[a:z], _w_up(run, j).t(), out=dx[a:z])


def gmm_w1_grad(run, t) -> None:
    x, dh, Fh = run.bufs["x_recv"], run.bufs["dh"], run.plan.bucket.ffn
    dw1 = _w(run, "dw1")
    dw3 = _w(run, "dw3") if "dw3" in run.bufs else None
    for j, segs in _expert_segments(run, t, "x_recv"):
        if dw3 is None:
            _weight_grad(x, dh, segs, dw1[j])
        else:  # straight into each gradient (strided columns of dh): no [H, 2F] copy
            _weight_grad(x, dh[:, :Fh], segs, dw1[j])
            _weight_grad(x, dh[:, Fh:], segs, dw3[j])


def sum_combine(run, t) -> None:
    rows = _token_rows(t)
    run.bufs["dx_TH"][rows] = _returned(run, "dx_ret", rows).sum(dim=1)


def topk_weight_grad(run, t) -> None:
    rows = _token_rows(t)
    dy = run.bufs["dy_TH"]
    ret_nKH = _returned(run, "y_ret", rows)
    run.bufs["dtopk_TK"][rows] = (ret_nKH * dy[rows].unsqueeze(1)).sum(dim=-1)


# Handler functions by name (``TaskType.handler`` in ``moe_graphs.TASK_TYPES``).
HANDLERS = {
    "put_dispatch": put_dispatch,
    "put_dispatch_grad": put_dispatch_grad,
    "put_combine": put_combine,
    "gmm_gate_up": gmm_gate_up,
    "swiglu": swiglu,
    "gelu": gelu,
    "gmm_down": gmm_down,
    "topk_combine": topk_combine,
    "gmm_act_grad": gmm_act_grad,
    "gmm_w2_grad": gmm_w2_grad,
    "swiglu_grad": swiglu_grad,
    "gelu_grad": gelu_grad,
    "gmm_gate_grad": gmm_gate_grad,
    "gmm_w1_grad": gmm_w1_grad,
    "sum_combine": sum_combine,
    "topk_weight_grad": topk_weight_grad,
}
