"""Build hook: ship ``pyserini_aligner.pth`` so the plugin registers itself at interpreter start-up."""
import os

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithStartupHook(build_py):
    """Copy the start-up ``.pth`` file to the top of the wheel (it lands in site-packages)."""

    def run(self) -> None:
        super().run()
        self.copy_file("pyserini_aligner.pth", os.path.join(self.build_lib, "pyserini_aligner.pth"))

    def get_outputs(self, include_bytecode: bool = True) -> list:
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, "pyserini_aligner.pth")]


setup(cmdclass={"build_py": BuildPyWithStartupHook})
