"""The accessors every double's ``*ForCausalLM``-style class has in its released code: the backbone is
``self.model`` (which owns the input embeddings) and the head ``self.lm_head``."""


class BackboneAndHeadAccessors:
    """transformers' embedding and decoder accessors over ``self.model`` and ``self.lm_head``."""

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def set_decoder(self, decoder):
        self.model = decoder

    def get_decoder(self):
        return self.model
