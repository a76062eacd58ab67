"""The build step pyproject.toml cannot say: a wheel (and so the image) ships the C kernels
compiled for every x86-64 target the loader dispatches to at run time (atomd/kernels/cbuild.py's
`prebuild`), so an installed engine never compiles and needs no compiler.

Skipped in an editable install (a checkout builds its kernels at first use) and off x86-64;
`ATOMD_PREBUILD=0` skips it on purpose. Without a C compiler the build fails: a wheel
without its kernels would run the torch fallbacks everywhere it is installed.
"""
import importlib.util
import os
import pathlib
import platform
import shutil

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).parent


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False) or os.environ.get("ATOMD_PREBUILD") == "0":
            return
        if platform.machine() not in ("x86_64", "AMD64"):
            print(f"atomd: no prebuilt kernels for {platform.machine()} (built at first use)")
            return
        compiler = os.environ.get("CC", "cc")
        if shutil.which(compiler) is None:
            raise SystemExit(f"atomd: the C kernels need a C compiler ({compiler}) to build the wheel "
                             "(ATOMD_PREBUILD=0 builds one without them: every kernel then builds at "
                             "first use, or falls back to torch where there is no compiler)")
        # cbuild.py alone, by path: importing atomd would need its dependencies here
        spec = importlib.util.spec_from_file_location("atomd_cbuild", HERE / "atomd" / "kernels" / "cbuild.py")
        cbuild = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(cbuild)
        built = cbuild.prebuild(pathlib.Path(self.build_lib) / "atomd" / "kernels" / "prebuilt", compiler)
        print(f"atomd: {len(built)} prebuilt kernels for {', '.join(cbuild.TARGETS)}")


class BinaryDistribution(Distribution):
    """The wheel holds x86-64 shared objects: tag it for the platform, not `any`."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=BinaryDistribution)
