"""The one strict config loader (megatron_ds_suite.core.config): YAML 1.2 numbers, strict keys and types,
``a.b=value`` overrides into nested sections and list items, one-line ConfigError messages."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import pytest
import yaml

from megatron_ds_suite.core.config import Fraction, Positive, Range, build_dataclass
from megatron_ds_suite.core.config_yaml import apply_overrides, merge_dicts, overrides_to_dict, parse_yaml, read_yaml
from megatron_ds_suite.core.errors import ConfigError, SuiteError


@dataclass
class Item:
    name: str = "a"
    weight: float = 1.0
    limit: int | None = None


@dataclass
class Inner:
    lr: float = 1.5e-4
    steps: int = 10
    enabled: bool = False
    mode: Literal["fast", "slow"] = "fast"
    tags: list[str] = field(default_factory=list)


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    items: list[Item] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    note: str | None = None
    threshold: float = 0.5


@dataclass
class NeedsName:
    name: str


def load(text: str, overrides: list[str] | None = None) -> Outer:
    return build_dataclass(Outer, apply_overrides(parse_yaml(text, "test config") or {}, overrides))


# ---------------------------------------------------------------------------------------------- YAML
@pytest.mark.parametrize("text,value", [("7e-1", 0.7), ("1e-4", 1e-4), ("1.0e-4", 1e-4), ("1.5e4", 15000.0),
                                        ("1E+3", 1000.0), ("-2e-3", -0.002), (".5e1", 5.0), ("0.7", 0.7),
                                        ("3", 3), ("true", True), ("null", None), ("abc1e2", "abc1e2")])
def test_yaml_1_2_numbers(text, value):
    got = parse_yaml(f"x: {text}", "t")["x"]
    assert got == value and type(got) is type(value)
    assert yaml.safe_load("x: 7e-1")["x"] == "7e-1"  # what plain PyYAML (YAML 1.1) does: the reason for the loader


def test_exponent_floats_reach_float_fields_from_file_and_overrides(tmp_path):
    cfg = load("inner: {lr: 1e-4}\nthreshold: 7e-1\n")
    assert cfg.inner.lr == 1e-4 and cfg.threshold == 0.7
    cfg = load("", ["inner.lr=2e-5", "threshold=7e-1"])
    assert cfg.inner.lr == 2e-5 and cfg.threshold == 0.7
    # a dict read by plain yaml.safe_load still works: the YAML 1.1 string '7e-1' is a float for a float field
    assert build_dataclass(Outer, yaml.safe_load("threshold: 7e-1")).threshold == 0.7
    p = tmp_path / "c.yaml"
    p.write_text("inner:\n  lr: 3e-4\n")
    assert build_dataclass(Outer, read_yaml(p)).inner.lr == 3e-4


def test_yaml_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^test config is not valid YAML: key 'a' appears twice") as e:
        parse_yaml("a: 1\nb: 2\na: 3\n", "test config")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"is not valid YAML: .*\(line 1, column \d+\)$"):
        parse_yaml("a: [1,", "test config")
    with pytest.raises(ConfigError, match=r"config file .*nope.yaml does not exist \(see configs/\)"):
        read_yaml(tmp_path / "nope.yaml", hint=" (see configs/)")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping of keys at top level, got a list"):
        read_yaml(tmp_path / "list.yaml")
    (tmp_path / "empty.yaml").write_text("# nothing\n")
    assert read_yaml(tmp_path / "empty.yaml") == {}
    assert issubclass(ConfigError, SuiteError)


# ------------------------------------------------------------------------------------ keys and types
def test_unknown_key_names_the_key_the_closest_and_the_valid_ones():
    with pytest.raises(ConfigError) as e:
        load("inner: {stpes: 3}")
    assert str(e.value) == ("unknown config key 'inner.stpes' (did you mean 'steps'?); valid keys here: "
                            "enabled, lr, mode, steps, tags")
    with pytest.raises(ConfigError, match=r"^unknown config key 'zzz'; valid keys here: extra, inner, items, note, "
                                          r"threshold$"):
        load("zzz: 1")
    with pytest.raises(ConfigError, match=r"unknown config key 'items\[1\].wieght' \(did you mean 'weight'\?\)"):
        load("items: [{name: a}, {wieght: 2}]")


@pytest.mark.parametrize("text,message", [
    ("inner: {steps: ten}", "inner.steps: expected an integer, got 'ten' (inner.steps must be int)"),
    ("inner: {steps: 2.5}", "inner.steps: expected an integer, got 2.5"),
    ("inner: {steps: true}", "inner.steps: expected an integer, got True"),  # a bool is not an int
    ("inner: {lr: high}", "inner.lr: expected a number, got 'high' (inner.lr must be float)"),
    ("inner: {lr: false}", "inner.lr: expected a number, got False"),
    ("inner: {lr: '1.5'}", "inner.lr: expected a number, got '1.5'"),  # a quoted number is a string
    ("inner: {enabled: 1}", "inner.enabled: expected true/false, got 1"),
    ("inner: {enabled: 'true'}", "inner.enabled: expected true/false, got 'true'"),
    ("inner: {enabled: null}", "inner.enabled: expected true/false, got None"),  # null only where allowed
    ("inner: {mode: medium}", "inner.mode: 'medium' is not one of 'fast', 'slow'"),
    ("inner: {tags: x}", "inner.tags: expected a list, got 'x'"),
    ("inner: {tags: [a, 3]}", "inner.tags[1]: expected a string, got 3"),
    ("inner: 5", "inner: expected a mapping of keys, got 5"),
    ("items: [{limit: x}]", "items[0].limit: expected an integer or null, got 'x' (items[0].limit must be int | null)"),
    ("note: [1]", "note: expected a string or null, got [1]"),
    ("extra: 3", "extra: expected a mapping, got 3"),
])
def test_type_errors_name_key_expected_type_and_value(text, message):
    with pytest.raises(ConfigError) as e:
        load(text)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_accepted_values_bool_int_none():
    cfg = load("inner: {steps: 3, lr: 2, enabled: true, tags: [x]}\nnote: null\nitems: [{limit: null}, {limit: 4}]\n"
               "extra: {anything: [1, {b: 2}]}")
    assert cfg.inner.lr == 2.0 and type(cfg.inner.lr) is float  # an int is a float
    assert cfg.inner.steps == 3 and cfg.inner.enabled is True and cfg.inner.tags == ["x"]
    assert cfg.note is None and [i.limit for i in cfg.items] == [None, 4] and isinstance(cfg.items[0], Item)
    assert cfg.extra == {"anything": [1, {"b": 2}]}
    assert load("") == Outer() and build_dataclass(Outer, None) == Outer()
    with pytest.raises(ConfigError, match="^name is required"):
        build_dataclass(NeedsName, {})
    assert build_dataclass(NeedsName, {"name": "x"}).name == "x"


# ---------------------------------------------------------------------------------------- overrides
def test_overrides_nested_lists_and_mappings():
    base = "inner: {lr: 1e-3, tags: [a, b]}\nitems: [{name: a}, {name: b, weight: 2}]\nextra: {x: {y: 1}}"
    cfg = load(base, ["inner.steps=7", "inner.tags.1=z", "items.1.weight=5e-1", "items.0.limit=null",
                      "extra={x: {z: 2}}", "note=", "threshold=1"])
    assert cfg.inner.steps == 7 and cfg.inner.lr == 1e-3 and cfg.inner.tags == ["a", "z"]
    assert cfg.items[1].weight == 0.5 and cfg.items[1].name == "b" and cfg.items[0].limit is None
    assert cfg.extra == {"x": {"y": 1, "z": 2}}  # a mapping value merges into the mapping there
    assert cfg.note == "" and cfg.threshold == 1.0
    cfg = load(base, ["inner.tags=[c]", "items=[{name: q}]", "inner.enabled=true"])  # a list value replaces
    assert cfg.inner.tags == ["c"] and [i.name for i in cfg.items] == ["q"] and cfg.inner.enabled is True
    assert load("inner: null", ["inner.steps=2"]).inner.steps == 2  # a null section is created
    assert load("", ["inner.steps=1", "inner.steps=2"]).inner.steps == 2  # later overrides win
    assert overrides_to_dict(["a.b=1", "a.c=x", "d=[1, 2]"]) == {"a": {"b": 1, "c": "x"}, "d": [1, 2]}


@pytest.mark.parametrize("override,message", [
    ("inner.steps", "override 'inner.steps' must look like key.subkey=value"),
    ("=3", "override '=3' must look like key.subkey=value"),
    ("inner..steps=3", "override 'inner..steps=3': empty key part"),
    ("items.2.name=x", "override 'items.2.name=x': '2' is not an index of items, a list of 2 item(s)"),
    ("items.first.name=x", "override 'items.first.name=x': 'first' is not an index of items"),
    ("inner.lr.x=1", "override 'inner.lr.x=1': inner.lr is float 0.001, not a section with keys"),
    ("inner.tags=[a,", "override 'inner.tags=[a,': the value is not valid YAML"),
    ("inner.stepz=3", "unknown config key 'inner.stepz' (did you mean 'steps'?)"),
    ("inner.steps=3.5", "inner.steps: expected an integer, got 3.5"),
])
def test_bad_overrides_fail_with_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        load("inner: {lr: 1e-3}\nitems: [{name: a}, {name: b}]", [override])
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_inputs_are_not_modified():
    data = {"inner": {"tags": ["a"]}, "extra": {"x": {"y": 1}}}
    apply_overrides(data, ["inner.tags.0=b", "extra.x.y=2"])
    merge_dicts(data, {"extra": {"x": {"y": 3}}})
    assert data == {"inner": {"tags": ["a"]}, "extra": {"x": {"y": 1}}}


# ----------------------------------------------------------------------------- the stages' configs
def test_every_stage_config_uses_the_one_loader():
    import data_pipeline.config as dp_config
    import training.config as train_config
    from megatron_ds_suite.core import errors

    assert dp_config.ConfigError is train_config.ConfigError is errors.ConfigError
    # the disagreement this loader removed: the data pipeline refused 7e-1, training accepted 1e-4
    assert dp_config.config_from_dict({"sources": [{"type": "default"}]},
                                      overrides=["dedup.threshold=7e-1"]).dedup.threshold == 0.7
    cfg = dp_config.config_from_dict({"sources": [{"type": "default", "limit": 3}]}, overrides=["sources.0.limit=5"])
    assert cfg.sources[0].limit == 5
    run = train_config.config_from_dict({"optimizer": {"lr": 1e-4}})
    assert run.optimizer.lr == 1e-4
    assert train_config.parse_overrides(["optimizer.lr=7e-1"]) == {"optimizer": {"lr": 0.7}}


def test_a_frozen_training_config_refuses_writes_and_copies_stay_frozen():
    import copy

    from megatron_ds_suite.core.config import FrozenConfigError, freeze, is_frozen
    from training.config import config_from_dict, load_config

    cfg = load_config("configs/gpt2_tiny.yaml", ["train.iters=7"])
    cfg.train.iters = 8  # mutable until the trainer has derived the layout
    assert freeze(cfg) is cfg and is_frozen(cfg) and is_frozen(cfg.model) and is_frozen(cfg.train)
    with pytest.raises(FrozenConfigError, match=r"frozen once the run layout is derived: TrainConfig\.iters cannot"):
        cfg.train.iters = 9
    with pytest.raises(FrozenConfigError, match=r"Config\.model cannot change"):
        cfg.model = cfg.model
    assert cfg.train.iters == 8
    dup = copy.deepcopy(cfg)
    assert is_frozen(dup.optimizer)
    with pytest.raises(FrozenConfigError):
        dup.optimizer.lr = 0.5
    fresh = config_from_dict(cfg.to_dict())  # the way to change values: a new config
    fresh.optimizer.lr = 0.5
    assert not is_frozen(fresh) and fresh.optimizer.lr == 0.5 and cfg.optimizer.lr != 0.5


# ---- numbers: finite everywhere, ranges declared on the fields (issue 38) -----------------------------------------
def _training(override: str):
    from training.config import load_config

    return load_config("configs/gpt2_tiny.yaml", ["data.corpus=/nonexistent/corpus", override])


def _corpus(override: str):
    from data_pipeline.config import config_from_dict

    return config_from_dict({"sources": [{"type": "default"}]}, overrides=[override])


def _main_job(override: str):
    from megatron_ds_suite.app.main_job.config import load_main_config

    return load_main_config(None, [override])


@pytest.mark.parametrize("load,override,message", [
    (_training, "optimizer.lr=.nan", "optimizer.lr: nan is not a finite number"),
    (_training, "optimizer.lr=.inf", "optimizer.lr: inf is not a finite number"),
    (_training, "optimizer.min_lr=-.inf", "optimizer.min_lr: -inf is not a finite number"),
    (_training, "model.init_method_std=.nan", "model.init_method_std: nan is not a finite number"),
    (_training, "model.layernorm_epsilon=-1e-5", "model.layernorm_epsilon must be > 0, got -1e-05"),
    (_training, "model.layernorm_epsilon=0", "model.layernorm_epsilon must be > 0, got 0.0"),
    (_training, "optimizer.eps=-1", "optimizer.eps must be > 0, got -1.0"),
    (_training, "optimizer.weight_decay=-0.1", "optimizer.weight_decay must be >= 0, got -0.1"),
    (_training, "optimizer.beta2=1", "optimizer.beta2 must be in [0, 1), got 1.0"),
    (_training, "optimizer.clip_grad=.inf", "optimizer.clip_grad: inf is not a finite number"),
    (_training, "precision.min_loss_scale=0", "precision.min_loss_scale must be > 0, got 0.0"),
    (_training, "train.seed=-3", "train.seed must be >= 0, got -3"),
    (_training, "model.hidden_dropout=1.5", "model.hidden_dropout must be in [0, 1), got 1.5"),
    (_training, "bert.masked_lm_prob=2", "bert.masked_lm_prob must be in (0, 1], got 2.0"),
    (_training, "finetune.warmup_fraction=-0.1", "finetune.warmup_fraction must be in [0, 1], got -0.1"),
    (_training, "run.device_peak_tflops=.nan", "run.device_peak_tflops: nan is not a finite number"),
    (_training, "run.device_peak_tflops=-1", "run.device_peak_tflops must be > 0, got -1.0"),
    (_training, "model.rope_scaling={factor: .inf}", "model.rope_scaling.factor: inf is not a finite number"),
    (_corpus, "dedup.lsh_weights=[.nan, 0.5]", "dedup.lsh_weights[0]: nan is not a finite number"),
    (_corpus, "dedup.lsh_weights=[-0.5, 1.5]", "dedup.lsh_weights[0] must be in [0, 1], got -0.5"),
    (_corpus, "ray.num_cpus_per_task=-1", "ray.num_cpus_per_task must be > 0, got -1.0"),
    (_corpus, "ray.num_cpus_per_task=.inf", "ray.num_cpus_per_task: inf is not a finite number"),
    (_corpus, "seed=-1", "seed must be >= 0, got -1"),
    (_corpus, "tokenizer.train_max_docs=0", "tokenizer.train_max_docs must be >= 1, got 0"),
    (_main_job, "network_timeout=.nan", "network_timeout: nan is not a finite number"),
    (_main_job, "network_timeout=-1", "network_timeout must be > 0, got -1.0"),
    (_main_job, "network_timeout=.inf", "network_timeout: inf is not a finite number"),
])
def test_non_finite_and_out_of_range_numbers_are_one_config_error(load, override, message):
    with pytest.raises(ConfigError) as e:
        load(override)
    assert message in e.value.one_line() and "\n" not in e.value.one_line()


def test_ranges_are_declared_once_and_also_hold_for_configs_built_in_python():
    """An importer builds a ModelConfig from another program's numbers and runs validate_static: the same ranges."""
    from training.config import load_config, validate_static

    for field_name, value, message in [("layernorm_epsilon", float("nan"), "not a finite number"),
                                       ("layernorm_epsilon", -1e-6, "must be > 0"),
                                       ("rotary_base", float("inf"), "not a finite number")]:
        cfg = load_config("configs/gpt2_tiny.yaml", ["data.corpus=/nonexistent/corpus"])
        setattr(cfg.model, field_name, value)
        with pytest.raises(ConfigError, match=f"model.{field_name}.*{message}"):
            validate_static(cfg)


@dataclass
class Opt:
    bound: Annotated[float, Range(finite=False)] = 1.0
    p: Annotated[float, Fraction] = 0.5
    timeout: Annotated[float, Positive] | None = None


def test_a_field_can_opt_in_to_non_finite_numbers_and_ranges_read_well():
    assert build_dataclass(Opt, {"bound": float("inf")}).bound == float("inf")
    assert build_dataclass(Opt, {"timeout": None}).timeout is None
    with pytest.raises(ConfigError, match=r"^p must be in \[0, 1\], got 1.5$"):
        build_dataclass(Opt, {"p": 1.5})
    with pytest.raises(ConfigError, match="timeout: nan is not a finite number"):
        build_dataclass(Opt, {"timeout": float("nan")})
    assert [Range(gt=0).describe(), Range(ge=1).describe(), Range(ge=0, lt=1).describe(), Range(le=2.5).describe()] == [
        "> 0", ">= 1", "in [0, 1)", "<= 2.5"]


# ---- nesting deeper than any config (issue 38) ---------------------------------------------------------------------
@pytest.mark.parametrize("depth", [150, 5000, 100_000])
@pytest.mark.parametrize("kind", ["list", "mapping"])
def test_deeply_nested_yaml_is_one_config_error(tmp_path, depth, kind):
    value = "[" * depth + "]" * depth if kind == "list" else "{a: " * depth + "1" + "}" * depth
    f = tmp_path / "c.yaml"
    f.write_text(f"deepspeed: {value}\n")
    with pytest.raises(ConfigError, match="nested deeper than"):
        read_yaml(f)
    with pytest.raises(ConfigError, match="nested deeper than"):
        apply_overrides({}, [f"deepspeed.x={value}"])


def test_nesting_up_to_the_limit_is_read():
    assert parse_yaml("[" * 100 + "]" * 100, "x") == eval("[" * 100 + "]" * 100)  # noqa: S307 -- a literal
    with pytest.raises(ConfigError, match="nested deeper than 100 levels"):
        parse_yaml("[" * 101 + "]" * 101, "x")
