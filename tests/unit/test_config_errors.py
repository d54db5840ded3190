"""Runtime configuration from the environment, and failure transport objects."""

import pickle
import threading

import pytest

from mpiscale.runtime.config import RuntimeConfig
from mpiscale.runtime.errors import Failure, RemoteError, RemoteTraceback


def test_defaults_work_without_environment():
    config = RuntimeConfig.from_env({})
    assert config == RuntimeConfig()
    assert config.thread_level == "multiple" and config.ranks_per_node == 0


def test_environment_overrides():
    config = RuntimeConfig.from_env(
        {
            "MPISCALE_SPIN_US": "50",
            "MPISCALE_RANKS_PER_NODE": "2",
            "MPISCALE_CHECK_COLLECTIVES": "off",
            "MPISCALE_SHUTDOWN_TIMEOUT_S": "2.5",
            "MPISCALE_THREAD_LEVEL": "funneled",
        }
    )
    assert (config.spin_us, config.ranks_per_node, config.check_collectives) == (50, 2, False)
    assert config.shutdown_timeout_s == 2.5 and config.thread_level == "funneled"


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("MPISCALE_SPIN_US", "fast", "MPISCALE_SPIN_US='fast' is not a valid int"),
        ("MPISCALE_CHUNK_BYTES", "0", "MPISCALE_CHUNK_BYTES must be >= 1"),
        ("MPISCALE_THREAD_LEVEL", "many", "use one of single, funneled, serialized, multiple"),
        ("MPISCALE_CHECK_COLLECTIVES", "maybe", "not a valid bool"),
        ("MPISCALE_MAX_SLEEP_US", "-1", "MPISCALE_MAX_SLEEP_US must be >= 0"),
        ("MPISCALE_HIERARCHICAL_MIN_BYTES", "-4096", "MPISCALE_HIERARCHICAL_MIN_BYTES must be >= 0"),
        ("MPISCALE_ALLREDUCE_PIECE_BYTES", "-1", "MPISCALE_ALLREDUCE_PIECE_BYTES must be >= 0"),
    ],
)
def test_bad_values_name_the_variable(variable, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RuntimeConfig.from_env({variable: value})


def test_one_setting_is_read_and_checked_as_every_setting_is():
    """``setting`` reads one variable (a blocking call's check, made often), with ``from_env``'s checks."""
    assert RuntimeConfig.setting("collective_check_s", {}) == RuntimeConfig().collective_check_s
    assert RuntimeConfig.setting("collective_check_s", {"MPISCALE_COLLECTIVE_CHECK_S": "2.5"}) == 2.5
    assert RuntimeConfig.setting("check_collectives", {"MPISCALE_CHECK_COLLECTIVES": "off"}) is False
    with pytest.raises(ValueError, match="MPISCALE_COLLECTIVE_CHECK_S must be >= 0"):
        RuntimeConfig.setting("collective_check_s", {"MPISCALE_COLLECTIVE_CHECK_S": "-1"})
    with pytest.raises(ValueError, match="MPISCALE_SPIN_US='fast' is not a valid int"):
        RuntimeConfig.setting("spin_us", {"MPISCALE_SPIN_US": "fast"})


def test_failure_keeps_type_and_chains_remote_traceback():
    try:
        raise KeyError("missing shard")
    except KeyError as error:
        failure = Failure.capture(error, "rank 3 on host n1, actor 'io' (Reader.load)")
    copy = pickle.loads(pickle.dumps(failure.picklable()))
    with pytest.raises(KeyError) as raised:
        copy.raise_here()
    cause = raised.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "rank 3 on host n1, actor 'io' (Reader.load)" in str(cause) and "missing shard" in str(cause)


def test_unpicklable_exception_becomes_remote_error():
    error = RuntimeError("has a lock")
    error.lock = threading.Lock()
    failure = Failure.capture(error, "rank 0").picklable()
    assert isinstance(failure.error, RemoteError) and "RuntimeError: has a lock" in str(failure.error)
    pickle.dumps(failure)
