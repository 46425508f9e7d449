"""The one way to patch: a patch leaves the patched object exactly as it found it — its own attribute back, or no
attribute of its own where it had none (an inherited one shows through again)."""

import pytest

from pytest_streamrace.patching import AttrPatch, patched


class Base:
    def greet(self):
        return "base"


def test_patched_restores_the_absence_of_an_own_attribute():
    obj = Base()
    with patched(obj, "greet", lambda: "patched"):
        assert obj.greet() == "patched"
    assert "greet" not in vars(obj)
    assert obj.greet() == "base"


def test_patched_restores_an_own_attribute_even_when_the_block_raises():
    class Child(Base):
        def greet(self):
            return "child"

    own = vars(Child)["greet"]
    with pytest.raises(RuntimeError), patched(Child, "greet", lambda self: "patched"):
        assert Child().greet() == "patched"
        raise RuntimeError("inside")
    assert vars(Child)["greet"] is own


def test_attr_patches_undone_in_reverse_order_give_back_the_first_original():
    first, second = AttrPatch(Base, "greet", lambda self: "one"), AttrPatch(Base, "greet", lambda self: "two")
    original = vars(Base)["greet"]
    first.install()
    second.install()
    assert Base().greet() == "two"
    second.uninstall()
    first.uninstall()
    assert vars(Base)["greet"] is original
