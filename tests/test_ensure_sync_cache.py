"""BlockgradFlask caches Flask's ensure_sync for the app's own functions only: a bound method
or partial made per request must not be kept alive by the cache."""
import functools
import gc
import weakref

from app.http.app import MOST_CACHED_HANDLERS, BlockgradFlask


def test_a_plain_function_is_wrapped_once():
    app = BlockgradFlask(__name__)

    def view():
        return "ok"
    assert app.ensure_sync(view) is app.ensure_sync(view)
    assert app.ensure_sync(view)() == "ok"


def test_a_bound_method_or_partial_made_per_request_is_not_kept():
    app = BlockgradFlask(__name__)

    class View:
        def dispatch(self):
            return "ok"
    view = View()
    alive = weakref.ref(view)
    assert app.ensure_sync(view.dispatch)() == "ok"
    assert app.ensure_sync(functools.partial(view.dispatch))() == "ok"
    del view
    gc.collect()
    assert alive() is None


def test_the_cache_is_bounded():
    app = BlockgradFlask(__name__)
    made = []
    for k in range(MOST_CACHED_HANDLERS + 50):  # bounded: a few hundred closures
        def handler(k=k):
            return k
        made.append(handler)
        assert app.ensure_sync(handler)() == k
    assert len(app._made_sync) == MOST_CACHED_HANDLERS
