"""A CPU stand-in for SGLang's MHA host KV pool (``pool_host/mha.py``), shared by
test_sglang_backend.py and llama_sglang.py.

SGLang's ``MHATokenToKVPoolHost`` cannot be imported on CPU here
(``sglang.srt.configs`` needs torchvision), so ``FakeHostPool`` keeps its buffer
shapes per layout and answers ``get_page_buffer_meta`` / ``get_data_page`` /
``set_from_flat_data_page`` as SGLang's does, from the tensor's own addresses: the
parts a storage backend touches, nothing else.
"""

from __future__ import annotations

import torch

LAYOUTS = ("page_first", "layer_first", "page_first_direct", "page_head")


class FakeHostPool:
    """The parts of SGLang's MHA host pool a storage backend touches, on CPU.

    ``kv_buffer`` has SGLang's shape for the layout; token ``t`` of layer ``l`` is
    ``kv_buffer[0 (K) or 1 (V), t, l]`` in ``page_first`` and
    ``kv_buffer[0 or 1, l, t]`` in ``layer_first``, as in SGLang.
    """

    def __init__(
        self,
        layout: str,
        dtype: torch.dtype = torch.float32,
        *,
        layers: int,
        heads: int,
        head_dim: int,
        page_tokens: int,
        pages: int,
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown host pool layout {layout!r}")
        self.layout = layout
        self.dtype = dtype
        self.page_size = page_tokens
        self.page_num = pages
        self.size = pages * page_tokens
        self.layer_num, self.head_num, self.head_dim = layers, heads, head_dim
        shapes = {
            "page_first": (2, self.size, layers, heads, head_dim),
            "layer_first": (2, layers, self.size, heads, head_dim),
            "page_first_direct": (2, pages, layers, page_tokens, heads, head_dim),
            "page_head": (2, pages, heads, page_tokens, layers, head_dim),
        }
        self.kv_buffer = torch.zeros(shapes[layout], dtype=dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """Pointers and byte sizes per page: K, V (per layer for layer_first)."""
        assert len(indices) % self.page_size == 0
        kv, itemsize = self.kv_buffer, self.kv_buffer.element_size()
        tokens, layers = self.page_size, self.layer_num
        token_bytes = self.head_num * self.head_dim * itemsize
        pointers: list[int] = []
        sizes: list[int] = []
        for start in indices.tolist()[:: self.page_size]:
            if self.layout == "layer_first":
                for layer in range(layers):
                    pointers += [kv[0, layer, start].data_ptr(), kv[1, layer, start].data_ptr()]
                    sizes += [tokens * token_bytes] * 2
            else:
                if self.layout == "page_first":
                    k, v = kv[0, start], kv[1, start]
                else:
                    k, v = kv[0, start // tokens], kv[1, start // tokens]
                pointers += [k.data_ptr(), v.data_ptr()]
                sizes += [layers * tokens * token_bytes] * 2
        return pointers, sizes

    def _page(self, index: int) -> torch.Tensor:
        tokens = self.page_size
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index : index + tokens]
        if self.layout == "page_first":
            return self.kv_buffer[:, index : index + tokens]
        page = index // tokens
        return self.kv_buffer[:, page : page + 1]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(index)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        elements = 2 * self.layer_num * self.page_size * self.head_num * self.head_dim
        return torch.zeros(elements, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self._page(index)
        page.copy_(data_page.reshape(page.shape))

    def fill(self, first_page: int, pages: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for page in range(first_page, first_page + pages):
            data = self.get_data_page(page * self.page_size)
            self.set_from_flat_data_page(
                page * self.page_size, torch.randn(data.shape, generator=generator)
            )

    def pages(self, first_page: int, pages: int) -> list[torch.Tensor]:
        return [
            self.get_data_page(p * self.page_size).clone()
            for p in range(first_page, first_page + pages)
        ]
