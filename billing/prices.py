"""Prices for the ledger: the gateway's price book (gateway/prices.py), the one price resolution
that the hot path's money holds use too. Billing keeps no price rules of its own. Money is
integer micro-dollars, never floats."""
from __future__ import annotations

import logging
from datetime import datetime

from gateway.models import ProviderKind
from gateway.prices import Price
from gateway.prices import PriceBook as GatewayPriceBook

log = logging.getLogger(__name__)

FREE = Price(0, 0)


class PriceBook(GatewayPriceBook):
    """The gateway's price book, for pricing ledger rows: PriceBook.load(), then price().

    A ledger row always gets a cost. The gateway refuses a model without a price, so a usage
    event of an unpriced model means every price of it was withdrawn between the call and the
    drain, or the event was not written by the gateway: the row is costed at 0 and logged at
    ERROR, because refusing to record the usage would lose it.
    """

    def price(self, model: str, at: datetime,  # type: ignore[override]
              kind: str = ProviderKind.OPENAI.value) -> Price:
        found = super().price(model, at, kind)
        if found is None:
            log.error("no price for model %r (%s kind) at %s: its ledger row is costed at 0",
                      model, kind, at.isoformat())
            return FREE
        return found
