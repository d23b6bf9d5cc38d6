"""The earlier layout's module paths (`eaglekit.target.*`, `eaglekit.draft.model`, as the README and docs showed them)
still import for one release: the module at the new path itself, with a DeprecationWarning that names it."""

from __future__ import annotations

import importlib
import sys

import pytest

from eaglekit.moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_gives_the_new_module_and_warns(old):
    for name in [n for n in sys.modules if n == old or n.startswith(old + ".")]:
        if name in MOVED:
            del sys.modules[name]  # the alias only: the new module stays loaded
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


def test_the_readme_s_old_imports_name_the_same_classes():
    from eaglekit.draft.model import Eagle3Drafter
    from eaglekit.drafters.eagle3.model import Eagle3Drafter as NewDrafter
    from eaglekit.target.capture import HiddenStateCapture
    from eaglekit.targets.capture import HiddenStateCapture as NewCapture

    assert Eagle3Drafter is NewDrafter and HiddenStateCapture is NewCapture


def test_every_new_path_exists():
    for new in MOVED.values():
        importlib.import_module(new)
