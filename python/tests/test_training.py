"""A small GPT trained with each half-precision stage as its attention learns as it does with
PyTorch's SDPA: the loss curves agree within the difference between two SDPA runs of other
model seeds (gpt.py builds the model and the corpus, and says the criterion in agreement()).

    python -m pytest python/tests/test_training.py
    FLASH_STAGES_TRAINING_TSV=training.tsv python -m pytest python/tests/test_training.py
    python3 python/tests/gpt.py --plot training.tsv --png training.png

Skipped without PyTorch, without a CUDA device, or when no half-precision stage loaded.
Runs of 300 steps: two SDPA seeds and each half-precision stage; then the grouped-query model
(GQA_CONFIG) with two SDPA seeds and flash_attn_func on Hopper.
"""
import importlib.util
import os
import sys

import pytest

try:
    import torch
except ImportError as e:  # not installed, or installed without the libraries it needs
    pytest.skip(f"PyTorch does not import: {e}", allow_module_level=True)

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("no CUDA device of compute capability 8.0 or later", allow_module_level=True)
try:
    try:
        import flash_stages
    except ImportError:  # not installed: the checkout's own package, python/flash_stages
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import flash_stages
except Exception as e:  # a missing package or a library that failed to load: no stage to test
    pytest.skip(f"flash_stages does not import: {e}", allow_module_level=True)
if not any(s in flash_stages.stages() for s in flash_stages.HALF_STAGES):
    pytest.skip("no half-precision stage library loaded (" +
                ", ".join(flash_stages.HALF_STAGES) + ")", allow_module_level=True)


def _load_gpt():
    """gpt.py beside this file (python/tests is not a package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt.py")
    spec = importlib.util.spec_from_file_location("gpt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpt = _load_gpt()
# The number of steps the criterion was chosen for (gpt.py): the curves' steep fall is over by
# the second half, which is what agreement() compares.
STEPS = 300


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    curves = gpt.run_comparison(steps=STEPS)
    tsv = os.environ.get("FLASH_STAGES_TRAINING_TSV") or str(
        tmp_path_factory.mktemp("training") / "training.tsv")
    gpt.write_tsv(tsv, curves)
    print(f"\nloss curves: {tsv}")
    gpt.report(curves)
    return curves


def _table(curves):
    """The report's table, for the assertion messages."""
    import io
    out = io.StringIO()
    gpt.report(curves, out)
    return out.getvalue()


@pytest.mark.parametrize("run", gpt.SDPA_RUNS)
def test_sdpa_learns(curves, run):
    """Without this, the comparison would be between curves that never moved."""
    first, final, ok = gpt.learned(curves[run])
    assert ok, (f"{run} did not learn: smoothed final loss {final:.4f} is not below "
                f"{gpt.LEARNED_FRACTION} x the first loss {first:.4f}\n{_table(curves)}")


@pytest.mark.parametrize("stage", [s for s in flash_stages.HALF_STAGES
                                   if s in flash_stages.stages()])
def test_stage_trains_like_sdpa(curves, stage):
    first, final, learned_ok = gpt.learned(curves[stage])
    assert learned_ok, (f"{stage} did not learn: smoothed final loss {final:.4f} is not below "
                        f"{gpt.LEARNED_FRACTION} x the first loss {first:.4f}\n{_table(curves)}")
    deviation, noise, ok = gpt.agreement(curves)[stage]
    assert ok, (f"{stage}'s loss curve leaves sdpa_seed0's by up to {deviation:.4f} nats over "
                f"the second half of training (smoothed over {gpt.SMOOTH_WINDOW} steps); two "
                f"SDPA seeds differ by {noise:.4f}\n{_table(curves)}")


def _gqa_backward_stage():
    """The stage flash_attn_func's default choice gives a grouped-query training call on this
    GPU, or None (12, the only grouped-query backward, needs compute capability 9.0)."""
    q = torch.zeros(1, 8, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.zeros(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    try:
        flash_stages.flash_attn_func(q, k, k, causal=True)
    except flash_stages.FlashStagesError:
        return None
    return flash_stages.last_call["stage"]


@pytest.fixture(scope="module")
def gqa_curves(tmp_path_factory):
    if _gqa_backward_stage() is None:
        pytest.skip("no loaded stage has a grouped-query backward on this GPU (12 needs "
                    "compute capability 9.0)")
    curves = gpt.run_comparison(steps=STEPS, config=gpt.GQA_CONFIG, flash_attn_func=True)
    tsv = os.environ.get("FLASH_STAGES_TRAINING_GQA_TSV") or str(
        tmp_path_factory.mktemp("training") / "training_gqa.tsv")
    gpt.write_tsv(tsv, curves, config=gpt.GQA_CONFIG)
    print(f"\ngrouped-query loss curves: {tsv}")
    gpt.report(curves)
    return curves


def test_gqa_model_trains_through_flash_attn_func_like_sdpa(gqa_curves):
    """The grouped-query GPT (4 query heads, 2 key/value heads) through flash_attn_func on
    [B, T, H, d], FlashAttention's layout, against SDPA (enable_gqa) on [B, H, T, d], by the
    same criterion as the stages."""
    for run in gpt.SDPA_RUNS:
        assert gpt.learned(gqa_curves[run])[2], f"{run} did not learn\n{_table(gqa_curves)}"
    first, final, learned_ok = gpt.learned(gqa_curves[gpt.GQA_RUN])
    assert learned_ok, (f"flash_attn_func did not learn: smoothed final loss {final:.4f} is not "
                        f"below {gpt.LEARNED_FRACTION} x the first loss {first:.4f}\n"
                        f"{_table(gqa_curves)}")
    deviation, noise, ok = gpt.agreement(gqa_curves)[gpt.GQA_RUN]
    assert ok, (f"flash_attn_func's loss curve leaves sdpa_seed0's by up to {deviation:.4f} "
                f"nats over the second half (two SDPA seeds differ by {noise:.4f})\n"
                f"{_table(gqa_curves)}")
