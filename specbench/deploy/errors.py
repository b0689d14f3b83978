"""The deployment's one-line errors. Two kinds of lost connection are told apart because the split treats them apart:
a link cut on purpose (the disconnection experiment: the client finishes alone) is `LinkDown`; a peer that vanished
(a server killed mid-answer) is `PeerGone`."""
from specbench.errors import SpecbenchError


class ProtocolError(SpecbenchError):
    """A frame this side cannot accept: not a specbench peer, another protocol version, a malformed message."""


class Refused(SpecbenchError):
    """The handshake found the two sides do not belong together (drafter, target or activations differ)."""


class PeerGone(SpecbenchError):
    """The other side closed or reset the connection (before a frame's end, or where a frame was awaited)."""


class LinkDown(SpecbenchError):
    """This side's emulated link was cut (LinkedSocket.cut): nothing more goes out or comes in over it."""


class PortInUse(SpecbenchError):
    """The server's address is taken by another process."""
