"""Every error class of the project derives from megatron_ds_suite.core.errors.SuiteError (docs/errors.md).

The classes are found by importing every module of the packages, so a new error class is checked without
being listed here."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from megatron_ds_suite.core.errors import ConfigError, SuiteError

PACKAGES = ("megatron_ds_suite", "data_pipeline", "training", "evaluation")

#: exceptions that are not bad input: outcomes of a run with their own exit code (docs/errors.md)
NOT_INPUT_ERRORS = {
    "training.trainer.TrainingAborted": "a run that went wrong (loss NaN, overflow streak): exit code 3",
    "megatron_ds_suite.app.main_job.state.StageFailed": "a stage's command failed: the main job names it and its log",
    "megatron_ds_suite.app.main_job.state.Skipped": "control flow: a stage that cannot run here, not an error",
}

#: error classes in modules this change could not edit (owned by other work in progress); each must move under
#: SuiteError and then leave this list -- the test fails for an entry that is fixed or gone
PENDING: set[str] = set()


def _project_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for pkg in PACKAGES:
        root = importlib.import_module(pkg)
        names = [pkg] + [m.name for m in pkgutil.walk_packages(root.__path__, f"{pkg}.")]
        for name in names:
            if name.rsplit(".", 1)[-1] == "__main__":  # runs the command line on import
                continue
            try:
                module = importlib.import_module(name)
            except ModuleNotFoundError as e:  # an optional extra that is not installed, never our own module
                if (e.name or "").split(".")[0] in PACKAGES:
                    raise
                continue
            for attr, obj in vars(module).items():
                if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name:
                    found[f"{name}.{attr}"] = obj
    return found


@pytest.fixture(scope="module")
def exceptions() -> dict[str, type[BaseException]]:
    return _project_exceptions()


def test_discovery_finds_the_known_classes(exceptions):
    for name in ("megatron_ds_suite.core.errors.ConfigError", "evaluation.errors.EvalError",
                 "training.safe_load.CheckpointError", "megatron_ds_suite.core.tokenizer_base.TokenizerError",
                 *NOT_INPUT_ERRORS, *PENDING):
        assert name in exceptions, f"{name} no longer exists: update this test"


def test_every_error_class_derives_from_suite_error(exceptions):
    wrong = sorted(n for n, cls in exceptions.items()
                   if not issubclass(cls, SuiteError) and n not in NOT_INPUT_ERRORS and n not in PENDING)
    assert not wrong, f"error classes outside SuiteError (see docs/errors.md): {wrong}"
    fixed = sorted(n for n in PENDING if issubclass(exceptions[n], SuiteError))
    assert not fixed, f"now derive from SuiteError: remove them from PENDING: {fixed}"


def test_one_config_error_class(exceptions):
    import data_pipeline.config
    import training.config

    assert data_pipeline.config.ConfigError is training.config.ConfigError is ConfigError
    named = [n for n, cls in exceptions.items() if cls.__name__ == "ConfigError"]
    assert named == ["megatron_ds_suite.core.errors.ConfigError"]
    assert issubclass(SuiteError, ValueError)  # callers that catch ValueError keep working


def test_one_line_and_report_error(capsys):
    from training.cli import report_error
    from training.safe_load import CheckpointError

    assert ConfigError("a\nb").one_line() == "config error: a b"
    assert CheckpointError("x").one_line() == "checkpoint error: x"
    assert SuiteError("y").one_line() == "error: y"
    assert report_error(ConfigError("bad key"), rank=1) == 2 and capsys.readouterr().err == ""  # one rank says it
    assert report_error(ConfigError("bad key")) == 2 and capsys.readouterr().err == "config error: bad key\n"


