"""Build hook: ship ``pyserini_aligner.pth`` so the plugin registers itself at interpreter start-up."""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

STARTUP_HOOK = "pyserini_aligner.pth"


class BuildPyWithStartupHook(build_py):
    """Put the start-up ``.pth`` file at the top of the wheel, where it lands in site-packages.

    A regular wheel takes it from ``build_lib``. An editable (PEP 660) wheel holds only what setuptools writes into
    the unpacked wheel (its ``install_lib``), so there the file is copied there as well.
    """

    def run(self) -> None:
        super().run()
        self.copy_file(STARTUP_HOOK, os.path.join(self.build_lib, STARTUP_HOOK))
        if self.editable_mode:
            wheel_root = self.get_finalized_command("install").install_lib
            self.copy_file(STARTUP_HOOK, os.path.join(wheel_root, STARTUP_HOOK))

    def get_outputs(self, include_bytecode: bool = True) -> list:
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, STARTUP_HOOK)]


setup(cmdclass={"build_py": BuildPyWithStartupHook})
