"""The only package that imports megatron: the third-party warnings every entry filters are
filtered before any module here imports megatron-core (megatron_ext/warning_filters.py)."""

from megatron_ext.warning_filters import install as _install_warning_filters

_install_warning_filters()
