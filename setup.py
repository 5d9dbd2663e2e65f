"""Build the one C extension (Bun.hash); everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore._wyhash",
            sources=["kvstore/_wyhash.c"],
            extra_compile_args=["-O3"],
        )
    ]
)
