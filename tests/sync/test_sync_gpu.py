"""GPU truth for the sync checksum: the Triton digest equals the torch reference on CUDA, for
views scattered over one storage (the span layout) and ragged sizes."""
import pytest
import torch

from polynya.distributed import checksum_named_tensors, tensor_digest
from polynya.sync.digest import checksum_views, digests_in_storage

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_digest_on_cuda(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    flat = (torch.randn(3_000_017, generator=g, device="cuda") * 50).to(dtype)
    starts, lens = [0, 4096, 100_000, 1_000_001, 2_999_000], [4096, 95_904, 900_001, 1_998_999, 1017]
    want = [tensor_digest(flat[s:s + n]) for s, n in zip(starts, lens)]
    assert digests_in_storage(flat, starts, lens) == want
    views = [(f"w{i}", flat[s:s + n].view(-1, 1)) for i, (s, n) in enumerate(zip(starts, lens))]
    assert checksum_views(views) == checksum_named_tensors(views)
