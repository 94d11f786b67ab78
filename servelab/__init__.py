"""Public import name of servelab for plugin authors: ``servelab.testing`` (conformance suites).

The implementation lives in ``framework``; this package only re-exports the stable parts.
"""

from framework.interfaces.base import INTERFACE_VERSION  # noqa: F401
