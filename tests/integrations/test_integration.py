"""The adapters' contract (co2_zero.integration) and the engine's one place for `overlap` and the sync
delay: no processes."""

import pytest
import torch

from co2_zero.core.schedule import ApplySchedule
from co2_zero.integration import Integration, check_fp32, check_fp32_parameters, one_device, trainable_parameters


def test_trainable_parameters_are_in_order_each_once_without_frozen_ones():
    a, b, frozen = torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True), torch.zeros(1)
    assert [id(p) for p in trainable_parameters([[a, frozen], [b, a]])] == [id(a), id(b)]


def test_the_fp32_check_names_the_parameter_its_shape_and_dtype_and_what_to_do():
    params = [torch.zeros(2), torch.zeros(3, 4, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match=r"^co2: parameter 1 \(shape \(3, 4\)\) is torch.bfloat16; use fp32$"):
        check_fp32_parameters(params, "use fp32")
    with pytest.raises(ValueError, match=r"^co2: the masters are torch.float16; x$"):
        check_fp32([("the masters are", torch.float16)], "x")
    check_fp32_parameters([torch.zeros(1)], "never raised")


def test_one_device_names_every_device_when_there_are_several():
    assert one_device([torch.zeros(1), torch.zeros(2)]) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"several devices \['cpu', 'meta'\]; expected one"):
        one_device([torch.zeros(1), torch.zeros(1, device="meta")])


def test_integration_names_are_the_strings_checkpoints_record():
    assert Integration.ALL == ("plain", "fsdp2", "fairscale", "deepspeed")


def test_the_schedule_decides_buffer_roles_the_wait_the_gap_and_the_final_start():
    start, nxt, gap = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    late, blocking, delayed = ApplySchedule(4, 4), ApplySchedule(0, 4), ApplySchedule(2, 4)
    plan = late.plan(start, nxt, gap)  # D overwrites the retiring start point, update a round late
    assert (plan.base, plan.work, plan.wait_at_once, plan.swap, plan.gap) == (nxt, start, False, True, gap)
    assert late.last_start(start, nxt) is nxt and all(late.carried_next_start(nxt, u) is nxt for u in (0, 1))
    plan = blocking.plan(start, nxt, gap)  # blocking: D in the spare buffer, applied at once, no gap
    assert (plan.base, plan.work, plan.wait_at_once, plan.swap, plan.gap) == (start, nxt, True, True, None)
    assert blocking.last_start(start, nxt) is start and blocking.carried_next_start(nxt, True) is None
    plan = delayed.plan(start, nxt, gap)  # a sync delay: applied to the base D was measured from, mid-round
    assert (plan.base, plan.work, plan.wait_at_once, plan.swap, plan.gap) == (start, nxt, False, False, gap)
    assert delayed.last_start(start, nxt) is start and delayed.carried_next_start(nxt, True) is nxt
    assert delayed.carried_next_start(nxt, False) is None  # from the apply point to the round end: none pending


def test_the_apply_point_comes_once_a_round():
    delayed = ApplySchedule(2, 4)
    assert [k for k in range(1, 13) if delayed.applies_mid_round(k)] == [2, 6, 10]
    assert not any(ApplySchedule(s, 4).applies_mid_round(k) for s in (0, 4) for k in range(1, 13))
