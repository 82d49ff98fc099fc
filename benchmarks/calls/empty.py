"""The empty call: its count is subtracted from every snippet's."""


def setup():
    def f():
        pass
    return f
