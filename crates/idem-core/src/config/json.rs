//! Reads JSON text into a [`serde_json::Value`], noting every repeated object key.
//!
//! `serde_json::from_str::<Value>` keeps the last of two equal keys silently, as grpc-go
//! and grpc-java's `JsonParser.parse` do; C-core's JSON reader refuses the document
//! (`duplicate key "…" at index …`). So that a config idem accepts is accepted by every
//! stack, idem reports a repeated key as an error, with its path.

use std::cell::RefCell;
use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

use super::read::child;

/// The document and the paths of the keys it repeats (in document order).
pub(crate) struct Read {
    pub(crate) value: Value,
    pub(crate) repeated: Vec<String>,
}

/// Parses `text` as one JSON value (trailing characters are an error, as in
/// `serde_json::from_str`).
pub(crate) fn read(text: &str) -> Result<Read, serde_json::Error> {
    let repeated = RefCell::new(Vec::new());
    let mut de = serde_json::Deserializer::from_str(text);
    let value = Seed {
        path: String::new(),
        repeated: &repeated,
    }
    .deserialize(&mut de)?;
    de.end()?;
    Ok(Read {
        value,
        repeated: repeated.into_inner(),
    })
}

struct Seed<'r> {
    path: String,
    repeated: &'r RefCell<Vec<String>>,
}

impl<'de> DeserializeSeed<'de> for Seed<'_> {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Seed<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        loop {
            let seed = Seed {
                path: format!("{}[{}]", self.path, items.len()),
                repeated: self.repeated,
            };
            match seq.next_element_seed(seed)? {
                Some(v) => items.push(v),
                None => return Ok(Value::Array(items)),
            }
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let path = child(&self.path, &key);
            if out.contains_key(&key) {
                self.repeated.borrow_mut().push(path.clone());
            }
            let v = map.next_value_seed(Seed {
                path,
                repeated: self.repeated,
            })?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_value_as_serde_json_and_repeated_keys_with_paths() {
        let text = r#"{"a": [1, -2, 2.5, "x", null, true, {"b": 1, "b": 2}], "a": {}, "c": {"d e": 1, "d e": 2}}"#;
        let r = read(text).unwrap();
        assert_eq!(r.value, serde_json::from_str::<Value>(text).unwrap());
        assert_eq!(r.repeated, vec!["a[6].b", "a", r#"c["d e"]"#]);
    }

    #[test]
    fn errors_are_serde_json_errors() {
        let e = read("{\"a\": 1} x").err().unwrap();
        assert_eq!((e.line(), e.column()), (1, 10));
        let deep = "[".repeat(200) + &"]".repeat(200);
        assert!(
            read(&deep).is_err(),
            "serde_json's recursion limit still applies"
        );
    }
}
