import pytest
import torch

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DTYPE_IDS = ["fp16", "bf16", "fp32"]

CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="CUDA not available: GPU test skipped")),
]


@pytest.fixture(params=DTYPES, ids=DTYPE_IDS)
def dtype(request):
    return request.param


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
