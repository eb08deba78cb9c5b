"""Makes `qcluster://` a kombu URL scheme once the package is installed (docs/CELERY.md).

kombu (5.x) finds a transport for a URL scheme only in `kombu.transport.TRANSPORT_ALIASES`, a
dict in its own source: it reads no entry points for transports, and it refuses a scheme that
names a module. So the package installs `qcluster-kombu.pth` beside itself in site-packages,
whose one line imports this module at interpreter start (as setuptools' own
`distutils-precedence.pth` does for `_distutils_hack`). This module imports nothing but `sys`
and puts one finder at the front of `sys.meta_path`. The finder answers no import but
`kombu.transport`'s, and only to wrap its loader: right after kombu's module has run, the
alias `qcluster -> client.kombu_transport:Transport` is added (unless one is there), and the
module's loader is put back as it was. Neither kombu nor the client library is imported
before the application imports kombu; an interpreter that never imports kombu pays one
string comparison per module it imports for the first time.

`client/kombu_transport.py` adds the same alias when it is imported, for a source checkout
run without installing the package.
"""
import sys

SCHEME = "qcluster"
TRANSPORT = "client.kombu_transport:Transport"
TARGET = "kombu.transport"


class _AliasLoader:
    """kombu.transport's own loader, adding the alias after the module ran."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        aliases = getattr(module, "TRANSPORT_ALIASES", None)
        if isinstance(aliases, dict):
            aliases.setdefault(SCHEME, TRANSPORT)
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader


class AliasFinder:
    """A meta path finder that only wraps kombu.transport's loader (see the module docstring)."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is cls:
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _AliasLoader(spec.loader)
        return spec


def install():
    """Put the finder first on sys.meta_path, once; if kombu.transport is already imported,
    add the alias there directly."""
    if AliasFinder not in sys.meta_path:
        sys.meta_path.insert(0, AliasFinder)
    module = sys.modules.get(TARGET)
    aliases = getattr(module, "TRANSPORT_ALIASES", None)
    if isinstance(aliases, dict):
        aliases.setdefault(SCHEME, TRANSPORT)


install()
