"""torchvision.transforms.v2.functional stand-in (see the package): any function is refused when called."""


def __getattr__(name):
    def refused(*args, **kwargs):
        raise RuntimeError(f"torchvision stand-in (tests/stand_ins): {name} is not available in these tests")
    return refused
