"""Every `LmiServeError` survives pickling with its class, message and attributes (the engine process sends
a request's error to the serving process: engine/process/), whatever its constructor takes."""

from __future__ import annotations

import pickle

import pytest

from lmiserve.core import errors
from lmiserve.engine.process.wire import portable

CLASSES = sorted(
    (c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.LmiServeError)),
    key=lambda c: c.__name__,
)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_each_error_class_round_trips(cls):
    if cls is errors.ContextLengthExceeded:
        error = cls("too long", input_tokens=300, max_new_tokens=20, max_total=256, max_input=200)
    elif cls is errors.ShuttingDown:
        error = cls()
    else:
        error = cls(f"a {cls.__name__}")
    error.extra = {"kept": [1, 2]}  # attributes a raiser set come along
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls
    assert (back.message, str(back), back.args) == (error.message, str(error), error.args)
    assert vars(back) == vars(error)


def test_an_error_that_does_not_pickle_is_named_instead():
    class Local(Exception):  # a local class cannot be pickled
        pass

    sent = portable(Local("boom"))
    assert isinstance(sent, errors.GenerationFailed)
    assert sent.message == "exception occurred during generation: Local: boom"
    kept = errors.InvalidRequest("bad")
    assert portable(kept) is kept
