"""python -m opsmith.c_flags: the flags that compile and link a C program
against the opsmith C library (opsmith.h, libopsmith.so), e.g.

    cc prog.c $(python -m opsmith.c_flags) -lm -o prog
"""
from ._library import c_flags

if __name__ == "__main__":
    print(c_flags())
