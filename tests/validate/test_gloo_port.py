"""A rendezvous port taken between the probe and rank 0's bind (EADDRINUSE, seen in a grid run beside other gloo
runs) is tried again on another; any other failure is not."""

import pytest

pytest.importorskip("torch")

from actmem_validate.gloo import on_a_free_port  # noqa: E402


def _starter(failures):
    ports = []

    def start(port):
        ports.append(port)
        if len(ports) <= len(failures):
            raise RuntimeError(failures[len(ports) - 1])
        return "measured"

    return start, ports


def test_a_taken_port_is_tried_again_on_another():
    start, ports = _starter(["DistNetworkError: ... code: -98, name: EADDRINUSE, message: address already in use"])
    assert on_a_free_port(start) == "measured"
    assert len(ports) == 2 and all(port > 0 for port in ports)


@pytest.mark.parametrize("failures, calls", [
    (["a rank of the t=2 run failed: RuntimeError: injected"], 1),       # any other failure: at once
    (["EADDRINUSE"] * 3, 3),                                              # taken three times: given up
])
def test_other_failures_and_a_port_always_taken_are_raised(failures, calls):
    start, ports = _starter(failures)
    with pytest.raises(RuntimeError, match=failures[-1]):
        on_a_free_port(start)
    assert len(ports) == calls
