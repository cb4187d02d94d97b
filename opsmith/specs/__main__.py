"""python -m opsmith.specs [--docs [PATH]]"""
import sys

from . import main

sys.exit(main())
