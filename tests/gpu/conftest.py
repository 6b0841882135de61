import megamoe  # noqa: F401  (before triton)

# isort: split
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("tests/gpu needs a CUDA device", allow_module_level=True)
