"""transformers causal LMs under moesaic's expert parallelism compute what transformers computes.

Per family (the tiny configs of ``examples/hf/``, random init, no download) the unmodified
transformers model and ``expert_parallel(copy)`` at EP 1, 2 and 4 (one spawned world per EP
size for every family together): logits, loss and every parameter's gradient, with the relative
rule (``assert_close_to_ref``: fp32 against the transformers model run in fp64, allowed twice
the error of the transformers model run in fp32). Ranks take their own slice of the batch
(rank r: sequences ``[r*B/P, (r+1)*B/P)``), each backpropagates its mean loss / P, so the
replicated gradients summed over ranks and the experts' (already holding every rank's tokens)
are the whole batch's. At EP 2 every registered strategy runs Mixtral; the EP 2 world also
takes one SGD step, gathers the experts with ``to_hf_state_dict`` and saves a plain
transformers directory that ``from_pretrained`` must read back to the same logits.

``python tests/test_hf_models.py`` prints the parity table (family x EP size, worst errors).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from moesaic.interop.hf_families import FAMILIES
from moesaic.strategies import strategy_names
from moesaic.testing import assert_close_to_ref, ref_errors, run_world

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "hf"
NAMES = sorted(FAMILIES)
EP_SIZES = (1, 2, 4)
BATCH, SEQ = 4, 12  # B divisible by every EP size: each rank gets B / P sequences
EAGER = {"attn_implementation": "eager", "experts_implementation": "eager"}


def _tiny(name: str, dtype: torch.dtype = torch.float32):
    """The transformers model of ``examples/hf/<name>.json``; weights from ``_weights``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(EXAMPLES / f"{name}.json"))
    # eager experts: transformers' default grouped_mm has no fp64 kernel
    model = AutoModelForCausalLM.from_config(cfg, **EAGER)
    model.load_state_dict(_weights(name))
    return model.to(dtype)


@functools.cache
def _weights(name: str) -> dict[str, torch.Tensor]:
    """Random weights, std 0.2 on matrices: router logits far apart (no near-tie that fp32 and
    fp64 would break differently) and activations of order 1."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(EXAMPLES / f"{name}.json"))
    torch.manual_seed(sorted(FAMILIES).index(name))
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
        for key, buf in model.named_buffers():  # DeepSeek-V3's bias of the top-k choice
            if key.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _batch() -> torch.Tensor:
    return torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def _run(model, x: torch.Tensor, scale: float = 1.0):
    out = model(input_ids=x, labels=x)
    (out.loss * scale).backward()
    return out.logits.detach(), out.loss.detach()


@functools.cache
def reference(name: str) -> dict[torch.dtype, tuple]:
    """The unmodified transformers model in fp32 and fp64: logits, loss, gradients."""
    out = {}
    for dtype in (torch.float32, torch.float64):
        model = _tiny(name, dtype)
        logits, loss = _run(model, _batch())
        out[dtype] = (logits, loss, {k: p.grad for k, p in model.named_parameters()})
    return out


def _converted(name: str, world: int, rank: int, dispatcher: str, save: str | None) -> dict:
    """One rank's logits, loss (mean over ranks) and gathered gradients; with ``save`` one SGD
    step, then the gathered model saved there (rank 0) and its logits on the whole batch."""
    import torch.distributed as dist

    import moesaic
    from moesaic.interop.hf import expert_parallel, to_hf_state_dict
    from moesaic.layer import is_expert_param

    model = expert_parallel(_tiny(name), dispatcher=dispatcher)
    x = _batch()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    logits, loss = _run(model, x[rows], scale=1.0 / world)
    moesaic.aux_loss(model)  # read and dropped: transformers' loss has no balance term here
    if world > 1:
        for p in model.parameters():  # replicated: sum the ranks' parts (experts have them)
            if not is_expert_param(p) and p.grad is not None:
                dist.all_reduce(p.grad)
        dist.all_reduce(loss)
    grads = to_hf_state_dict(model, grads=True)
    result = {"logits": logits, "loss": loss / world, "grads": grads}
    if save is not None:
        result["trained_logits"] = _step_and_save(name, model, x, save if rank == 0 else None)
    return result


def _step_and_save(name: str, model, x: torch.Tensor, save: str | None) -> torch.Tensor:
    import moesaic
    from moesaic.interop.hf import to_hf_state_dict

    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
        logits = model(input_ids=x).logits
    moesaic.aux_loss(model)
    sd = to_hf_state_dict(model)  # a collective: every rank
    if save is not None:
        plain = _tiny(name)
        plain.load_state_dict(sd)
        plain.save_pretrained(f"{save}/{name}")
    return logits


def world_worker(rank: int, world: int, jobs: list[tuple[str, str]], save: str | None) -> dict:
    torch.set_num_threads(1)
    # One saved model per family: the default strategy's.
    return {
        (n, d): _converted(n, world, rank, d, save if d == "dropless" else None) for n, d in jobs
    }


def _jobs(world: int) -> list[tuple[str, str]]:
    jobs = [(name, "dropless") for name in NAMES]
    if world == 2:
        jobs += [("mixtral", s) for s in strategy_names() if s != "dropless"]
    return jobs


@functools.cache
def ep_results(world: int, save: str | None) -> dict:
    """Every job of an EP size: per (family, strategy) the ranks' results merged."""
    if world == 1:
        per_rank = [world_worker(0, 1, _jobs(1), save)]
    else:
        per_rank = run_world(world_worker, world, _jobs(world), save, timeout_s=240)
    return {
        job: {
            "logits": torch.cat([r[job]["logits"] for r in per_rank]),
            "loss": per_rank[0][job]["loss"],
            "grads": per_rank[0][job]["grads"],
            "trained_logits": per_rank[0][job].get("trained_logits"),
        }
        for job in per_rank[0]
    }


def parity_errors(name: str, got: dict) -> dict[str, dict]:
    """Per compared tensor: ``ref_errors`` (max abs / rel error, allowance, ok)."""
    ref32, ref64 = reference(name)[torch.float32], reference(name)[torch.float64]
    out = {
        "logits": ref_errors(got["logits"], ref32[0], ref64[0], torch.float32),
        "loss": ref_errors(got["loss"], ref32[1], ref64[1], torch.float32),
    }
    assert set(got["grads"]) == set(ref64[2]), set(got["grads"]) ^ set(ref64[2])
    for key, g in got["grads"].items():
        assert g.shape == ref64[2][key].shape, key
        out[f"grad {key}"] = ref_errors(g, ref32[2][key], ref64[2][key], torch.float32)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hf_saved"))


@pytest.mark.parametrize("ep", EP_SIZES)
@pytest.mark.parametrize("name", NAMES)
def test_logits_loss_and_gradients_match_transformers(name, ep, saved):
    got = ep_results(ep, saved if ep == 2 else None)[(name, "dropless")]
    ref32, ref64 = reference(name)[torch.float32], reference(name)[torch.float64]
    assert_close_to_ref(got["logits"], ref32[0], ref64[0], f"{name} EP {ep} logits")
    assert_close_to_ref(got["loss"], ref32[1], ref64[1], f"{name} EP {ep} loss")
    for key, e in parity_errors(name, got).items():
        assert e["ok"], f"{name} EP {ep} {key}: {e}"


@pytest.mark.parametrize("strategy", [s for s in strategy_names() if s != "dropless"])
def test_every_strategy_runs_a_transformers_model(strategy, saved):
    got = ep_results(2, saved)[("mixtral", strategy)]
    for key, e in parity_errors("mixtral", got).items():
        assert e["ok"], f"mixtral EP 2 {strategy} {key}: {e}"


@pytest.mark.parametrize("name", NAMES)
def test_trained_model_round_trips_to_plain_transformers(name, saved):
    from transformers import AutoModelForCausalLM

    trained = ep_results(2, saved)[(name, "dropless")]["trained_logits"]
    x = _batch()
    logits = {}
    for dtype in (torch.float32, torch.float64):
        plain = AutoModelForCausalLM.from_pretrained(f"{saved}/{name}", dtype=dtype, **EAGER)
        assert not any(type(m).__name__ == "HFMoEBlock" for m in plain.modules())
        with torch.no_grad():
            logits[dtype] = plain(input_ids=x).logits
    assert_close_to_ref(trained, logits[torch.float32], logits[torch.float64], f"{name} logits")


def test_refuses_other_families_by_name():
    from transformers import GptOssConfig, GptOssForCausalLM

    from moesaic.interop.hf import expert_parallel

    cfg = GptOssConfig(
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        vocab_size=64,
    )
    with pytest.raises(ValueError, match=r"'gpt_oss' is not supported.*biases"):
        expert_parallel(GptOssForCausalLM(cfg))
    model = _tiny("mixtral")
    model.config.model_type = "my_moe"
    with pytest.raises(
        ValueError, match=r"'my_moe' is not supported.*supported: deepseek_v3, granitemoe"
    ):
        expert_parallel(model)


def test_refuses_router_jitter():
    from moesaic.interop.hf import expert_parallel

    model = _tiny("mixtral")
    model.model.layers[0].mlp.jitter_noise = 0.1
    with pytest.raises(ValueError, match=r"router_jitter_noise 0\.1"):
        expert_parallel(model)


def _table() -> str:
    lines = ["| family | EP | logits abs / rel | loss abs / rel | worst gradient abs / rel |"]
    lines.append("| --- | --- | --- | --- | --- |")
    for name in NAMES:
        for ep in EP_SIZES:
            errs = parity_errors(name, ep_results(ep, None)[(name, "dropless")])
            grads = [e for k, e in errs.items() if k.startswith("grad")]
            worst = max(grads, key=lambda e: e["max_rel_err"])
            cells = [errs["logits"], errs["loss"], worst]
            txt = [f"{e['max_abs_err']:.1e} / {e['max_rel_err']:.1e}" for e in cells]
            ok = all(e["ok"] for e in errs.values())
            lines.append(f"| {name} | {ep} | {' | '.join(txt)} |" + ("" if ok else " FAIL"))
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(_table())
    sys.exit(0)
