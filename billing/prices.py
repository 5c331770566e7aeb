"""What a model costs at a moment: ModelPrice rows (with validity periods) over the catalog's
list prices (gateway.ModelSpec). Money is integer micro-dollars, never floats."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from billing.models import ModelPrice
from gateway.catalog import price_micros
from gateway.models import ModelSpec


@dataclass(frozen=True)
class Price:
    input_micros_per_mtok: int
    output_micros_per_mtok: int

    def cost(self, input_tokens: int, output_tokens: int) -> int:
        """Micro-dollars, rounded half up once per call."""
        return price_micros(self.input_micros_per_mtok, self.output_micros_per_mtok,
                            input_tokens, output_tokens)


FREE = Price(0, 0)


class PriceBook:
    """Every price, loaded in two queries, for pricing a batch of usage events."""

    def __init__(self, periods: Iterable[ModelPrice], list_prices: dict[str, Price]) -> None:
        self._periods: dict[str, list[ModelPrice]] = {}
        for period in periods:
            self._periods.setdefault(period.model, []).append(period)
        self._list = list_prices

    @classmethod
    def load(cls) -> PriceBook:
        list_prices = {
            spec.name: Price(spec.input_price_micros_per_mtok, spec.output_price_micros_per_mtok)
            for spec in ModelSpec.objects.all()
        }
        return cls(ModelPrice.objects.all(), list_prices)

    def price(self, model: str, at: datetime) -> Price:
        for period in self._periods.get(model, ()):
            if period.valid_from <= at and (period.valid_to is None or at < period.valid_to):
                return Price(period.input_micros_per_mtok, period.output_micros_per_mtok)
        return self._list.get(model, FREE)
