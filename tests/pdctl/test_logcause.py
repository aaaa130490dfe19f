"""The few log lines that say why a service failed (appliance.pdctl.node.logcause)."""

from __future__ import annotations

from appliance.pdctl.node.logcause import error_excerpt

BAD_ARG = """\
(APIServer pid=1) INFO 12-02 06:40:01 [utils.py:1] vLLM API server version 0.32.0
Traceback (most recent call last):
  File "/opt/venv/lib/python3.11/site-packages/vllm/engine/arg_utils.py", line 1955, in f
    return ModelConfig(
           ^^^^^^^^^^^^
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (100000) is greater than the derived max_model_len
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""


def test_a_multi_line_exception_message_is_one_line():
    assert error_excerpt(BAD_ARG) == [
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig: "
        "Value error, User-specified max_model_len (100000) is greater than the derived "
        "max_model_len"]


def test_process_prefixes_and_repeats_go_warnings_never_count():
    log = ("(APIServer pid=1) WARNING 12-02 06:28:19 [x.py:2] failed with error: ulimit\n"
           "(Worker pid=9) ERROR 12-02 06:29:03 [m.py:1] OSError: [Errno 12] Cannot allocate\n"
           "(EngineCore pid=8) ERROR 12-02 06:29:03 [c.py:5] OSError: [Errno 12] Cannot allocate\n"
           "RuntimeError: Engine core initialization failed. See root cause above.\n")
    assert error_excerpt(log) == ["OSError: [Errno 12] Cannot allocate"]


def test_preflight_verdicts_and_a_log_without_errors():
    assert error_excerpt("pd-preflight: error: no RDMA device\n") == [
        "pd-preflight: error: no RDMA device"]
    assert error_excerpt("one\ntwo\n\nthree\nfour\nfive\n") == ["two", "three", "four", "five"]


def test_many_errors_keep_the_first_ones_and_the_last():
    log = "".join(f"ValueError: problem {i}\n" for i in range(8))
    assert error_excerpt(log, limit=4) == ["ValueError: problem 0", "ValueError: problem 1",
                                           "ValueError: problem 2", "ValueError: problem 7"]
