"""A collective's failure becomes one CommTimeout line only when it is a timeout, whatever gloo's or NCCL's
wording; any other error passes through unchanged."""

import pytest
import torch

from parallel import comm
from tests import REPO


@pytest.fixture
def ledger_at_step_3():
    comm.LEDGER.reset(step=3)
    comm.LEDGER.timeout_s = 5.0
    comm.set_where("unit", "backward of layers.1")
    yield
    comm.LEDGER.reset()
    comm.LEDGER.timeout_s = None


@pytest.mark.parametrize("wording", [
    "[../gloo/transport/tcp/pair.cc:534] Timed out waiting 5000ms for recv operation to complete",
    "Application timeout caused pair closure",  # gloo, on a rank whose peer timed out first
    "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=REDUCE_SCATTER)",
])
def test_a_timeout_in_any_wording_names_the_op_group_step_and_unit(ledger_at_step_3, wording):
    with pytest.raises(comm.CommTimeout) as caught:
        with comm.traced("wait reduce_scatter", None, "head"):
            raise RuntimeError(wording)
    assert str(caught.value) == ("reduce_scatter of head on group world did not complete within "
                                 "comm_timeout_s=5 (step 3, backward of layers.1)")
    assert str(caught.value.__cause__) == wording


def test_other_errors_pass_through(ledger_at_step_3):
    with pytest.raises(RuntimeError) as caught:
        with comm.traced("all_reduce", None):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    assert type(caught.value) is RuntimeError


@pytest.mark.parametrize("collective", [
    lambda: comm.all_reduce(torch.zeros(2), None),
    lambda: comm.all_gather_into_tensor(torch.zeros(4), torch.zeros(2), None),
    lambda: comm.reduce_scatter_tensor(torch.zeros(2), torch.zeros(4), None),
    lambda: comm.batch_isend_irecv([(True, torch.zeros(2), 1)], None),
    lambda: comm.barrier(None),
    lambda: comm.all_gather_object("x", None),
])
def test_a_collective_refuses_group_none_which_here_means_no_group(collective):
    """A parallel dimension of size 1 has group None (size_of(None) == 1); torch.distributed would take
    None for every rank, so a collective reached with it would silently reduce over the whole job."""
    comm.LEDGER.reset()
    with pytest.raises(ValueError, match="group=None, which here means no group"):
        collective()
    assert comm.LEDGER.by_op() == {}


def test_no_source_passes_none_to_a_collective():
    """Scripts that tests only import (the benches) would meet the refusal above only when run."""
    import re

    root = REPO
    call = re.compile(r"comm\.(all_reduce|all_gather_into_tensor|reduce_scatter_tensor|batch_isend_irecv|barrier|"
                      r"all_gather_object)\((?:[^()]|\([^()]*\))*\bNone\b")
    offenders = [f"{path.relative_to(root)}: {m.group(0)}" for folder in ("parallel", "model", "trainer", "scripts")
                 for path in (root / folder).rglob("*.py") for m in call.finditer(path.read_text())]
    assert not offenders, offenders
