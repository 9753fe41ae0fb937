//! GGUF metadata: typed values, an ordered key table and typed accessors.

use std::collections::HashMap;
use std::fmt;

use crate::error::MetadataError;

/// The type tag of a metadata value, as stored in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The smallest encoding of one value of this type: caps element counts by the bytes
    /// left in the file (a string is at least its 8-byte length, an array its 4-byte type
    /// and 8-byte count).
    pub fn min_encoded_size(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }

    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

/// One metadata value. Arrays carry their element type so that empty arrays keep it.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// A short description of the value's type, for error messages (`array of string`).
    pub fn type_description(&self) -> String {
        match self {
            Value::Array(t, _) => format!("array of {}", t.name()),
            v => v.value_type().name().to_string(),
        }
    }

    /// The value as a signed 128-bit integer, for any integer type.
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as a float, for the float types.
    pub fn as_float(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }
}

impl fmt::Display for Value {
    /// Compact rendering for `memra inspect`: long arrays are summarized.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 8;
        match self {
            Value::String(s) => write!(f, "{s:?}"),
            Value::Array(t, items) => {
                write!(f, "[{} x {}]", items.len(), t.name())?;
                if !items.is_empty() {
                    f.write_str(" [")?;
                    for (i, v) in items.iter().take(SHOWN).enumerate() {
                        if i > 0 {
                            f.write_str(", ")?;
                        }
                        write!(f, "{v}")?;
                    }
                    if items.len() > SHOWN {
                        f.write_str(", ...")?;
                    }
                    f.write_str("]")?;
                }
                Ok(())
            }
            Value::F32(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            v => write!(f, "{}", v.as_integer().unwrap_or_default()),
        }
    }
}

/// The metadata table of a GGUF file, in file order, with lookup by key.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
    index: HashMap<String, usize>,
}

impl Metadata {
    pub fn new() -> Metadata {
        Metadata::default()
    }

    /// Inserts a key. Returns `false` (and changes nothing) when the key already exists.
    pub fn insert(&mut self, key: impl Into<String>, value: Value) -> bool {
        let key = key.into();
        if self.index.contains_key(&key) {
            return false;
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value));
        true
    }

    /// Inserts or replaces a key, keeping its original position when it exists.
    pub fn set(&mut self, key: impl Into<String>, value: Value) {
        let key = key.into();
        match self.index.get(&key) {
            Some(&i) => self.entries[i].1 = value,
            None => {
                self.insert(key, value);
            }
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    pub fn contains(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// `general.architecture`, the key every model file must have.
    pub fn architecture(&self) -> Result<&str, MetadataError> {
        self.require(self.get_str("general.architecture"), "general.architecture")
    }

    /// Turns an optional lookup into a required one.
    pub fn require<T>(
        &self,
        found: Result<Option<T>, MetadataError>,
        key: &str,
    ) -> Result<T, MetadataError> {
        found?.ok_or_else(|| MetadataError::Missing(key.to_string()))
    }

    fn wrong(key: &str, expected: &'static str, v: &Value) -> MetadataError {
        MetadataError::WrongType {
            key: key.to_string(),
            expected,
            found: v.type_description(),
        }
    }

    fn integer<T: TryFrom<i128>>(
        &self,
        key: &str,
        expected: &'static str,
    ) -> Result<Option<T>, MetadataError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let i = v
            .as_integer()
            .ok_or_else(|| Metadata::wrong(key, expected, v))?;
        T::try_from(i)
            .map(Some)
            .map_err(|_| MetadataError::OutOfRange {
                key: key.to_string(),
                expected,
                value: i.to_string(),
            })
    }

    /// An integer key of any integer type whose value fits a `u32`.
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>, MetadataError> {
        self.integer(key, "an unsigned 32-bit integer")
    }

    /// An integer key of any integer type whose value fits a `u64`.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>, MetadataError> {
        self.integer(key, "an unsigned 64-bit integer")
    }

    /// An integer key of any integer type whose value fits an `i64`.
    pub fn get_i64(&self, key: &str) -> Result<Option<i64>, MetadataError> {
        self.integer(key, "a signed 64-bit integer")
    }

    /// A float key (f32 or f64).
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>, MetadataError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_float()
                .map(|f| Some(f as f32))
                .ok_or_else(|| Metadata::wrong(key, "a float", v)),
        }
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>, MetadataError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(Metadata::wrong(key, "a bool", v)),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<Option<&str>, MetadataError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(Metadata::wrong(key, "a string", v)),
        }
    }

    fn array(
        &self,
        key: &str,
        expected: &'static str,
    ) -> Result<Option<(ValueType, &[Value])>, MetadataError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(t, items)) => Ok(Some((*t, items))),
            Some(v) => Err(Metadata::wrong(key, expected, v)),
        }
    }

    /// An array of strings (`tokenizer.ggml.tokens`, `tokenizer.ggml.merges`).
    pub fn get_str_array(&self, key: &str) -> Result<Option<Vec<&str>>, MetadataError> {
        const EXPECTED: &str = "an array of strings";
        let Some((t, items)) = self.array(key, EXPECTED)? else {
            return Ok(None);
        };
        if t != ValueType::String {
            return Err(MetadataError::WrongType {
                key: key.to_string(),
                expected: EXPECTED,
                found: format!("array of {}", t.name()),
            });
        }
        Ok(Some(
            items
                .iter()
                .map(|v| match v {
                    Value::String(s) => s.as_str(),
                    _ => unreachable!("array elements match the array type"),
                })
                .collect(),
        ))
    }

    /// An array of floats (`tokenizer.ggml.scores`).
    pub fn get_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>, MetadataError> {
        const EXPECTED: &str = "an array of floats";
        let Some((t, items)) = self.array(key, EXPECTED)? else {
            return Ok(None);
        };
        items
            .iter()
            .map(|v| v.as_float().map(|f| f as f32))
            .collect::<Option<Vec<f32>>>()
            .map(Some)
            .ok_or_else(|| MetadataError::WrongType {
                key: key.to_string(),
                expected: EXPECTED,
                found: format!("array of {}", t.name()),
            })
    }

    /// An array of integers of any integer type, each fitting an `i64`
    /// (`tokenizer.ggml.token_type`, per-layer head counts).
    pub fn get_i64_array(&self, key: &str) -> Result<Option<Vec<i64>>, MetadataError> {
        const EXPECTED: &str = "an array of integers";
        let Some((t, items)) = self.array(key, EXPECTED)? else {
            return Ok(None);
        };
        let mut out = Vec::with_capacity(items.len());
        for v in items {
            let i = v.as_integer().ok_or_else(|| MetadataError::WrongType {
                key: key.to_string(),
                expected: EXPECTED,
                found: format!("array of {}", t.name()),
            })?;
            out.push(i64::try_from(i).map_err(|_| MetadataError::OutOfRange {
                key: key.to_string(),
                expected: "i64 elements",
                value: i.to_string(),
            })?);
        }
        Ok(Some(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_accessors_convert_and_reject() {
        let mut m = Metadata::new();
        assert!(m.insert("a", Value::U8(7)));
        assert!(!m.insert("a", Value::U8(8)), "duplicate insert must fail");
        m.insert("neg", Value::I32(-1));
        m.insert("big", Value::U64(u64::MAX));
        m.insert("s", Value::String("x".into()));
        m.insert(
            "arr",
            Value::Array(ValueType::String, vec![Value::String("t".into())]),
        );
        m.insert("f", Value::F64(0.5));
        assert_eq!(m.get_u32("a").unwrap(), Some(7));
        assert_eq!(m.get_u64("a").unwrap(), Some(7));
        assert_eq!(m.get_u32("missing").unwrap(), None);
        assert!(matches!(
            m.get_u32("neg"),
            Err(MetadataError::OutOfRange { .. })
        ));
        assert!(matches!(
            m.get_u32("big"),
            Err(MetadataError::OutOfRange { .. })
        ));
        assert_eq!(m.get_i64("neg").unwrap(), Some(-1));
        assert!(matches!(
            m.get_u32("s"),
            Err(MetadataError::WrongType { .. })
        ));
        assert!(matches!(
            m.get_str("a"),
            Err(MetadataError::WrongType { .. })
        ));
        assert_eq!(m.get_str_array("arr").unwrap(), Some(vec!["t"]));
        assert!(m.get_f32_array("arr").is_err());
        assert_eq!(m.get_f32("f").unwrap(), Some(0.5));
        assert!(matches!(
            m.architecture(),
            Err(MetadataError::Missing(k)) if k == "general.architecture"
        ));
        let keys: Vec<&str> = m.iter().map(|(k, _)| k).collect();
        assert_eq!(keys, ["a", "neg", "big", "s", "arr", "f"]);
    }
}
