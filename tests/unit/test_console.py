"""mcit.core.console: library chatter goes to the rank log, this project's own warnings still reach the console."""

from __future__ import annotations

import importlib.util
import logging
import warnings

from mcit.core import console


def _library_module(tmp_path):
    """A module outside this project that warns, logs and prints, as torch / transformers / DeepSpeed do."""
    src = tmp_path / "somelib.py"
    src.write_text("import logging, warnings\n"
                   "def talk():\n"
                   "    warnings.warn('somelib is deprecated', FutureWarning)\n"
                   "    logging.getLogger('somelib').warning('somelib kernel missing')\n"
                   "    print('somelib op built successfully')\n")
    spec = importlib.util.spec_from_file_location("somelib", src)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_library_output_is_kept_until_the_log_file_then_written_there(tmp_path, capsys):
    lib = _library_module(tmp_path)
    shown: list[str] = []
    with warnings.catch_warnings():  # restores warnings.showwarning on exit
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *a, **k: shown.append(str(message))  # the console's printer
        console.quiet_libraries()
        try:
            _talk_and_log(lib, tmp_path)
        finally:
            console.restore()
    out = capsys.readouterr()
    text = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    for said in ("somelib is deprecated", "somelib kernel missing", "somelib op built successfully",
                 "some weights were not used", "zero stage note"):
        assert said in text, said
        assert said not in out.out + out.err, said
    assert "a warning of this project's own code" not in text
    assert shown == ["a warning of this project's own code"]  # handed to the console's own printer


def _talk_and_log(lib, tmp_path) -> None:
    """A library talks before the run directory is known, then the log opens and more is said."""
    with console.stdout_to_log("somelib"):
        lib.talk()  # kept in memory
    from deepspeed.utils.logging import LoggerFactory

    # what importing deepspeed does (after quiet_libraries, in a real run): a stdout handler, no propagation
    LoggerFactory.create_logger(name="DeepSpeed", level=logging.WARNING)
    console.log_to(tmp_path / "run" / "logs" / "rank0.log")
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger("transformers.modeling_utils").warning("some weights were not used")
    logging.getLogger("DeepSpeed").warning("zero stage note")
    from mcit.core import distributed

    warnings.warn_explicit("a warning of this project's own code", UserWarning, distributed.__file__, 59)


def test_a_second_run_in_the_same_process_logs_to_its_own_file(tmp_path):
    """Several runs in one process (``run_task_sequence.py --config A --config B``): each run's log gets its own
    lines."""
    first = console.log_to(tmp_path / "a" / "rank0.log")
    logging.getLogger("transformers.x").warning("said during run a")
    second = console.log_to(tmp_path / "b" / "rank0.log")
    logging.getLogger("transformers.x").warning("said during run b")
    for h in logging.getLogger().handlers:
        h.flush()
    assert "said during run a" in first.read_text() and "said during run b" not in first.read_text()
    assert "said during run b" in second.read_text()
