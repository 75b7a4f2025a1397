"""The DeepSpeed JSON the trainer derives (training.ds_json.deepspeed_config): what it turns off by default."""
from deepspeed.utils.config import get_timers_config

from training.config import config_from_dict
from training.ds_json import deepspeed_config


def test_throughput_timer_is_off_unless_asked_for():
    """DeepSpeed's throughput timer (on by default: it synchronises the device twice per micro-batch) is off
    in every derived config, read back by DeepSpeed's own parser; the deepspeed: section turns it on."""
    assert get_timers_config({}).enabled  # DeepSpeed's default, the reason we set it
    for dtype in ("fp32", "fp16", "bf16"):
        ds = deepspeed_config(config_from_dict({}), 1, dtype)
        assert ds["timers"] == {"throughput": {"enabled": False}}
        assert not get_timers_config(ds).enabled
    asked = config_from_dict({"deepspeed": {"timers": {"throughput": {"enabled": True}}}})
    assert get_timers_config(deepspeed_config(asked, 1, "fp16")).enabled
