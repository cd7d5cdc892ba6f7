"""The app and the server that hosts it know each other through app/core/host.py only: the
factory and the app's layers import no app.serving, app.serving imports neither the app's
layers nor wsgi (gunicorn loads wsgi:app itself). Read from the source, function bodies too."""
from tests.test_architecture import IMPORTS, MODULES, ROOT, all_imports

APP_SIDE = ("app.http", "app.api", "app.extensions", "wsgi")


def test_the_app_imports_no_serving_module():
    for name, imported in IMPORTS.items():
        if not name.startswith("app.serving"):
            assert not {i for i in imported if i.startswith("app.serving")}, f"{name} imports app.serving"


def test_serving_imports_neither_the_app_nor_wsgi():
    for name, path in MODULES.items():
        if name.startswith("app.serving"):
            found = {i for i in all_imports(path) if i.startswith(APP_SIDE) or i in ("app", "app.create_app")}
            assert not found, f"{name} imports {found}"


def test_the_config_file_imports_no_app_module():
    found = {i for i in all_imports(ROOT / "gunicorn.conf.py") if i.startswith(APP_SIDE) or i == "app.create_app"}
    assert not found, found
