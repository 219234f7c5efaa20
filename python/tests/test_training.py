"""A small GPT trained with each half-precision stage as its attention learns as it does with
PyTorch's SDPA: the loss curves agree within the difference between two SDPA runs of other
model seeds (gpt.py builds the model and the corpus, and says the criterion in agreement()).

    python -m pytest python/tests/test_training.py
    FLASH_STAGES_TRAINING_TSV=training.tsv python -m pytest python/tests/test_training.py
    python3 python/tests/gpt.py --plot training.tsv --png training.png

Skipped without PyTorch, without a CUDA device, or when no half-precision stage loaded.
Five runs of 300 steps (two SDPA seeds, three stages).
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
