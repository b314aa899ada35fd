"""JSON schemas for the structured-output tests: nested objects, arrays, enums,
required fields, string patterns. Not a test module."""

# NOTE: bounded (maxLength, maxItems, patterns): a random-weight model inside an
# unbounded string rarely closes it within max_tokens.
SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False,
               "required": ["user", "score"],
               "properties": {"user": {"type": "object", "additionalProperties": False,
                                       "required": ["name", "age"],
                                       "properties": {"name": {"type": "string", "maxLength": 8},
                                                      "age": {"type": "integer", "minimum": 0,
                                                              "maximum": 120}}},
                              "score": {"type": "integer", "minimum": -50, "maximum": 50}}},
    "array": {"type": "array", "minItems": 1, "maxItems": 4,
              "items": {"type": "integer", "minimum": -5, "maximum": 99}},
    "enum": {"type": "object", "required": ["color", "size"], "additionalProperties": False,
             "properties": {"color": {"enum": ["red", "green", "blue"]},
                            "size": {"type": "string", "enum": ["S", "M", "L"]},
                            "ok": {"type": "boolean"}}},
    "pattern": {"type": "object", "required": ["id", "email"], "additionalProperties": False,
                "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                               "email": {"type": "string",
                                         "pattern": "^[a-z]{1,6}@[a-z]{1,5}\\.(com|org)$"}}},
    "array_of_objects": {"type": "object", "required": ["items"], "additionalProperties": False,
                         "properties": {"items": {"type": "array", "maxItems": 3, "items": {
                             "type": "object", "required": ["k", "v"], "additionalProperties": False,
                             "properties": {"k": {"enum": ["a", "b"]},
                                            "v": {"type": "integer", "maximum": 9, "minimum": 0}}}}}},
}
