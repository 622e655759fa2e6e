"""Extension names that survive a new process."""

from __future__ import annotations

from kernelfleet.evaluator._extensions import stable_name


def test_the_process_id_in_a_name_becomes_pid() -> None:
    assert stable_name("huber_loss_cuda_4242", pid=4242) == "huber_loss_cuda_pid"
    assert stable_name("ext_4242_v2", pid=4242) == "ext_pid_v2"


def test_other_numbers_stay() -> None:
    assert stable_name("conv2d_14242", pid=4242) == "conv2d_14242"
    assert stable_name("conv2d_42421", pid=4242) == "conv2d_42421"
    assert stable_name("fused_relu", pid=4242) == "fused_relu"
