"""The toolkit as a framework's tests use it from docs/testing.md: a rank process that ends
before it is ready, the world's own event names, faults that could never fire, fields an
exception lacks, acting on a rank by its number."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from m2n_async.testing import (
    LocalWorld,
    RankResult,
    assert_same_failure,
)

World = Callable[[int, int], LocalWorld]
REPO = Path(__file__).resolve().parents[2]


# -- a rank process that ends before it is ready ---------------------------------------------








# -- the world's own event names ------------------------------------------------------------










# -- faults that could never fire ----------------------------------------------------------












# -- the failure contract: what an exception lacks -----------------------------------------


def _raised(*errors: BaseException) -> list[RankResult]:
    return [RankResult(r, "worker", "error", error=e) for r, e in enumerate(errors)]


@pytest.mark.parametrize(("kw", "match"), [
    ({"phase": "hello"}, r"rank 0: ValueError has no `phase` attribute, so its phase cannot be "
                         r"'hello'"),
    ({"culprit": 1}, r"rank 0: ValueError has no `rank`, `failures` or `ranks` attribute"),
    ({"cause": "lost"}, r"ValueError has no `cause` attribute"),
    ({"round": 1}, r"ValueError has no `round` attribute"),
])
def test_assert_same_failure_says_which_field_an_exception_lacks(
        kw: dict[str, object], match: str) -> None:
    res = _raised(ValueError("bad"), ValueError("bad"))
    with pytest.raises(AssertionError, match=match):
        assert_same_failure(res, ValueError, **kw)  # type: ignore[arg-type]
    assert_same_failure(res, ValueError)  # nothing asked of those fields: the same failure


def test_a_field_that_is_there_but_none_is_a_value_not_a_lack() -> None:
    class Blames(Exception):
        rank = None  # the store's failure: nobody to blame

    res = _raised(Blames("x"), Blames("x"))
    assert_same_failure(res, Blames, culprit=None)
    with pytest.raises(AssertionError, match=r"rank 0: culprit is None, expected 1"):
        assert_same_failure(res, Blames, culprit=1)


# -- acting on a rank by its number ----------------------------------------------------------


