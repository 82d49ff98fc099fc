"""A sample pool kept in its own module (as CycleGAN's util/image_pool.py): the loss-graph tests' holder class."""


class Pool:
    def __init__(self):
        self.items = []

    def add(self, x):
        self.items.append(x)  # keeps every step's graph when x is not detached
        return x
