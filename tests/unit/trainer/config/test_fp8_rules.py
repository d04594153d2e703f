"""fp8 fails before step 1, with one line: a TE sequence-parallel local input TE would refuse at its first
forward (tp=4 seq_len=48: 12 local rows), fp8 on a CUDA device below sm89 (capability monkeypatched), and
an fp8-gathered weight view off a 16-byte boundary (where the views are made, and at build)."""

import sys

import pytest
import torch

from model.fp8 import Fp8Gemm, Fp8Recipe
from parallel.errors import ConfigError
from parallel.fsdp.flat_param import FlatParamSpec
from parallel.fsdp.fp8_gather import Fp8Gather, Fp8Param, fp8_weight_view
from tests import REPO
from tests.unit.trainer.config.test_config import load
from trainer.config.fp8_rules import check_fp8_device
from trainer.config.rules import validate

TE_SP = ("model.use_te_layers=true", "model.use_fp8=true", "model.n_kv_heads=4", "model_parallel_size=4",
         "model.sequence_parallel=true")


@pytest.fixture
def te_on_cuda(monkeypatch, request):
    """The stand-in TE on a machine that says it has CUDA (validation checks TE's presence and version)."""
    monkeypatch.syspath_prepend(str(REPO / "tests" / "fake_te"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    request.addfinalizer(lambda: [sys.modules.pop(m) for m in list(sys.modules) if m.startswith("transformer_engine")])


def test_te_sequence_parallel_local_rows_must_divide_by_8(te_on_cuda):
    with pytest.raises(ConfigError) as err:
        validate(load(*TE_SP, "seq_len=48"), world_size=4)
    message = str(err.value)
    assert "TransformerEngine's sequence-parallel LayerNormLinear" in message and "\n" not in message
    rows = "microbatch_size x seq_len / context_parallel_size / model_parallel_size"
    assert f"{rows} = 12 is not a multiple of 8" in message
    validate(load(*TE_SP, "seq_len=64"), world_size=4)  # 16 local rows
    validate(load(*TE_SP[:4], "seq_len=48"), world_size=4)  # without SP TE sees all 48 rows
    validate(load(*TE_SP[1:], "seq_len=48"),
             world_size=4)  # the in-tree fp8 gathers before its GEMMs: 48 rows


@pytest.mark.parametrize("capability, accepted", [((7, 0), False), ((8, 0), False), ((8, 6), False), ((8, 9), True),
                                                  ((9, 0), True), ((10, 0), True)])
def test_fp8_needs_sm89_on_cuda(monkeypatch, capability, accepted):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    cuda = torch.device("cuda", 0)
    cfg = load("model.use_fp8=true")
    check_fp8_device(cfg, torch.device("cpu"))  # the in-tree fp8 emulates its GEMMs on CPU
    check_fp8_device(load(), cuda)  # no fp8: nothing to check
    if accepted:
        check_fp8_device(cfg, cuda)
        return
    with pytest.raises(ConfigError) as err:
        check_fp8_device(cfg, cuda)
    major, minor = capability
    assert str(err.value).startswith("model.use_fp8=true needs a GPU of compute capability 8.9 or newer")
    assert f"Some GPU (cuda:0) is sm{major}{minor}" in str(err.value)


def _param(offset: int) -> Fp8Param:
    return Fp8Param(offset, 16 * 16, torch.Size([16, 16]), Fp8Gemm(Fp8Recipe()))


def test_fp8_gathered_views_must_be_16_byte_aligned():
    gathered = torch.empty(1024, dtype=torch.uint8)
    assert gathered.data_ptr() % 16 == 0
    assert fp8_weight_view(gathered, _param(16), "layers.0").dtype == torch.float8_e4m3fn
    with pytest.raises(AssertionError, match=r"FSDP unit layers.0: .* at byte 8 .* not 16-byte aligned"):
        fp8_weight_view(gathered, _param(8), "layers.0")
    with pytest.raises(AssertionError, match="not 16-byte aligned"):  # an aligned offset of a misaligned buffer
        fp8_weight_view(gathered[1:], _param(16), "layers.0")

    # At build: a norm weight of 8 elements before the fp8 weight puts it at byte 8.
    spec = FlatParamSpec(("norm.weight", "w.weight"), (torch.Size([8]), torch.Size([16, 16])), world=1)
    with pytest.raises(AssertionError, match="at byte 8 of the gathered bytes"):
        Fp8Gather(spec, 0, None, torch.float32, [_param(8)], "layers.0", torch.device("cpu"))
