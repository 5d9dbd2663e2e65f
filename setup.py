"""Build the one C extension (Bun.hash); everything else is in pyproject.toml.

The extension is optional: without a C compiler (a Mac without the command-line
developer tools) the install goes on and kvstore.formats.bunhash uses its pure-Python
port, which gives the same values, slower (the README says how much)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore._wyhash",
            sources=["kvstore/_wyhash.c"],
            extra_compile_args=["-O3"],
            optional=True,  # a failed build is a warning: the pure-Python port takes over
        )
    ]
)
