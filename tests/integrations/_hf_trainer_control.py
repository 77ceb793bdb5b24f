"""Control for tests/integrations/test_hf_trainer_deepspeed.py: examples/hf_trainer_deepspeed.py with the hook's
``GlobalOptimManager`` follow-up switched off (the parameter's override stays off its views).

Launched like the example: ``deepspeed --num_gpus 2 tests/integrations/_hf_trainer_control.py --stage 2 ...``.
"""

import contextlib
import pathlib
import runpy
import sys

from blockshard.integrations.deepspeed import _hook

_hook.resolve_module_overrides = lambda optimizer, params: None
_hook.follow_overrides = lambda optimizer, params, views: contextlib.nullcontext()
examples = pathlib.Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(examples))  # what running the example as a script does (its _common import)
runpy.run_path(str(examples / "hf_trainer_deepspeed.py"), run_name="__main__")
