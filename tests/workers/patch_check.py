"""What importing co2_zero and patching do to DeepSpeed's `initialize`, in a fresh interpreter.

    python tests/workers/patch_check.py deepspeed   # import co2_zero.deepspeed; patch() switches it on
    python tests/workers/patch_check.py hf          # import co2_zero.hf; CO2Callback() switches it on

`deepspeed.initialize` is looked up before co2_zero is imported (as a script doing `from deepspeed import
initialize` would). Prints one JSON line: for each moment, whether the function object runs DeepSpeed's
original code object (`is`) with its original defaults and attributes ("original"), or not ("changed").
tests/integrations/test_deepspeed.py and tests/integrations/test_hf.py check the line.
"""

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402

FUNCTION = deepspeed.initialize
ORIGINAL = (FUNCTION.__code__, FUNCTION.__defaults__, FUNCTION.__kwdefaults__, dict(FUNCTION.__dict__))


def state() -> str:
    now = (FUNCTION.__code__, FUNCTION.__defaults__, FUNCTION.__kwdefaults__, dict(FUNCTION.__dict__))
    same = all(a is b for a, b in zip(now[:3], ORIGINAL[:3])) and now[3] == ORIGINAL[3]
    return "original" if same else "changed"


def main(route: str) -> None:
    seen = {}
    if route == "hf":
        from co2_zero.hf import CO2Callback

        switch_on = CO2Callback
    else:
        from co2_zero.deepspeed import patch

        switch_on = patch
    import co2_zero.deepspeed as co2_deepspeed

    seen["imported"] = state()
    switch_on()
    seen["patched"] = state()
    routed = FUNCTION.__code__
    switch_on()
    seen["patched twice, same code"] = FUNCTION.__code__ is routed
    co2_deepspeed.unpatch()
    seen["unpatched"] = state()
    co2_deepspeed.unpatch()
    seen["unpatched twice"] = state()
    with co2_deepspeed.patch():
        seen["in with patch()"] = state()
    seen["after with patch()"] = state()
    print(json.dumps(seen))


if __name__ == "__main__":
    main(sys.argv[1])
