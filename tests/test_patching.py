"""The one way to patch: a patch leaves the patched object exactly as it found it — its own attribute back, or no
attribute of its own where it had none (an inherited one shows through again)."""

import pytest

from pytest_streamrace.patching import AttrPatch, WrapPatch, patched


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


def test_a_wrap_patch_installed_again_reuses_its_wrapper_over_the_same_original_and_rewraps_a_new_one():
    """Sessions install the same patch objects in turn: over the attribute they wrapped before, the wrapper is the
    one built then; over another (someone replaced it between sessions), a new wrapper of what is there now."""
    class Target:
        def method(self):
            return "original"

    made = []

    def wrap(original):
        def wrapper(self):
            return "wrapped " + original(self)
        made.append(wrapper)
        return wrapper

    original = Target.method
    patch = WrapPatch(Target, "method", wrap)
    for _ in range(2):
        patch.install()
        assert Target().method() == "wrapped original"
        patch.uninstall()
        assert Target.method is original
    assert len(made) == 1

    def replaced(self):
        return "replaced"

    Target.method = replaced
    patch.install()
    assert Target().method() == "wrapped replaced" and len(made) == 2
    patch.uninstall()
    assert Target.method is replaced


def test_the_live_test_file_is_read_whole_or_not_at_all(tmp_path):
    """The parent rewrites the live test file in place; a child that reads it half written sees a bad checksum and
    reads again, and one that never gets a whole record takes its default rather than a mix of two nodeids."""
    from pytest_streamrace.children import child
    from pytest_streamrace.children.following import Following

    following = Following("virtual", False)
    try:
        following.follow("tests/test_a.py::test_long_name[param]")
        following.follow("tests/test_b.py::test_x")
        assert child.live_test(following.dir) == "tests/test_b.py::test_x"
        following.unfollow()
        assert child.live_test(following.dir, "default") == ""
    finally:
        following.close()
    torn = child.live_record("tests/test_b.py::test_x")[:-3] + b"ram]"  # a shorter record over a longer one's tail
    (tmp_path / child.CURRENT).write_bytes(torn)
    assert child.live_test(str(tmp_path), "default") == "default"
