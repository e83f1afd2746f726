"""Environment values read with a bound and named when bad (reliability-5 S9, the values half):
a device variable is quoted short, a GPU count is ASCII digits within a bound, a memory size is at
least a byte and at most 1 EiB; on the command line each is one line that leads with the
variable."""

from __future__ import annotations

import pytest

from flexdispatch._checks import sysmem
from flexdispatch.distributed import env_int
from flexdispatch.launch import devices
from tests.hostile import cli_error

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("value", ["\u00b2", "9" * 20, "-1", "\u0662", "x" * 5000])
def test_a_gpu_count_is_ascii_digits_within_a_bound(monkeypatch, value):
    # reliability-5: '²' raised int()'s own error without the variable; 10**20 was 10**20 GPUs
    monkeypatch.setenv(devices.VISIBLE_GPUS_ENV, value)
    with pytest.raises(ValueError, match=r"^\$FLEXDISPATCH_VISIBLE_GPUS=") as info:
        devices.visible_gpus()
    assert len(str(info.value)) <= 120, str(info.value)
    monkeypatch.setenv(devices.VISIBLE_GPUS_ENV, " 3 ")
    assert devices.visible_gpus() == (3, "$FLEXDISPATCH_VISIBLE_GPUS")


def test_a_device_value_is_quoted_short(monkeypatch):
    # reliability-5: the 5,000 characters were quoted whole (5,089 in the message)
    monkeypatch.setenv(devices.DEVICE_ENV, "x" * 5000)
    with pytest.raises(
        ValueError, match=r"^\$FLEXDISPATCH_DEVICE='x{12}'… is not a device"
    ) as info:
        devices.requested_device()
    assert len(str(info.value)) <= 120, len(str(info.value))


def test_env_int_reads_ascii_digits_only(monkeypatch):
    monkeypatch.setenv("FLEXDISPATCH_THREADS", "\u0662")  # int() reads the Arabic-Indic 2
    with pytest.raises(ValueError, match=r"\$FLEXDISPATCH_THREADS='\\u0662' is not an integer"):
        env_int("FLEXDISPATCH_THREADS", minimum=1)
    monkeypatch.setenv("FLEXDISPATCH_THREADS", " 2 ")
    assert env_int("FLEXDISPATCH_THREADS", minimum=1) == 2


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("1" * 30 + "TiB", "is more than 1 EiB"),  # was 1.2e41 bytes: every check off
        ("0.0000000001", "is not a positive memory size"),  # was 0 bytes
        ("0.5B", "is not a positive memory size"),
        ("\u0664GiB", "is not a memory size"),
    ],
)
def test_a_memory_size_is_a_byte_to_an_exbibyte(text, problem):
    with pytest.raises(ValueError, match=r"^\$FLEXDISPATCH_MEMORY_AVAILABLE=") as info:
        sysmem.parse_size(text, "$FLEXDISPATCH_MEMORY_AVAILABLE")
    assert problem in str(info.value)
    assert sysmem.parse_size("1TiB", "$X") == 1 << 40
    assert sysmem.parse_size("1.5G") == 3 << 29


@pytest.mark.parametrize(
    ("env", "option"),
    [
        ({"FLEXDISPATCH_DEVICE": "x" * 5000}, "$FLEXDISPATCH_DEVICE"),
        ({"FLEXDISPATCH_VISIBLE_GPUS": "\u00b2"}, "$FLEXDISPATCH_VISIBLE_GPUS"),
        ({"FLEXDISPATCH_VISIBLE_GPUS": "9" * 20}, "$FLEXDISPATCH_VISIBLE_GPUS"),
        ({"FLEXDISPATCH_MEMORY_AVAILABLE": "0.0000000001"}, "$FLEXDISPATCH_MEMORY_AVAILABLE"),
    ],
    ids=["device", "gpus-superscript", "gpus-huge", "memory-zero"],
)
def test_the_command_line_leads_with_the_variable(monkeypatch, capsys, env, option):
    import flexdispatch.launch as launch

    monkeypatch.setattr(launch, "spawn_group", lambda *a, **k: pytest.fail("spawned"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    line = cli_error(["demo", "--iters", "1"], capsys)
    assert line.startswith(f"flexdispatch demo: error: {option} "), line
    assert "x" * 40 not in line
