"""What every command's argument parser shares: a bad argument is one line
on stderr (naming the command and the problem) and exit status 2."""
import argparse


class Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")
