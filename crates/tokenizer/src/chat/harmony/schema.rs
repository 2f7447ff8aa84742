//! Tool parameter schemas: JSON that keeps its keys' order, and its rendering as the TypeScript-like
//! types harmony shows the model.
//!
//! The workspace's `serde_json` sorts object keys, but the rendered properties must follow the schema's
//! own order, so schemas deserialize into [`Json`].

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use std::fmt;

/// A JSON value whose objects keep their keys in the order given.
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Number(serde_json::Number),
    String(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl Json {
    /// The value of `key` in an object.
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Object(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Json]> {
        match self {
            Json::Array(items) => Some(items),
            _ => None,
        }
    }

    fn str_of(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Json::as_str)
    }
}

/// Compact JSON, as `serde_json` writes a value.
impl fmt::Display for Json {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Json::Null => f.write_str("null"),
            Json::Bool(b) => write!(f, "{b}"),
            Json::Number(n) => write!(f, "{n}"),
            Json::String(s) => write!(f, "{}", serde_json::Value::from(s.as_str())),
            Json::Array(items) => {
                f.write_str("[")?;
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{item}")?;
                }
                f.write_str("]")
            }
            Json::Object(entries) => {
                f.write_str("{")?;
                for (i, (k, v)) in entries.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{}:{v}", serde_json::Value::from(k.as_str()))?;
                }
                f.write_str("}")
            }
        }
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Json, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Json;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_unit<E>(self) -> Result<Json, E> {
                Ok(Json::Null)
            }
            fn visit_none<E>(self) -> Result<Json, E> {
                Ok(Json::Null)
            }
            fn visit_bool<E>(self, b: bool) -> Result<Json, E> {
                Ok(Json::Bool(b))
            }
            fn visit_i64<E>(self, n: i64) -> Result<Json, E> {
                Ok(Json::Number(n.into()))
            }
            fn visit_u64<E>(self, n: u64) -> Result<Json, E> {
                Ok(Json::Number(n.into()))
            }
            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<Json, E> {
                serde_json::Number::from_f64(n)
                    .map(Json::Number)
                    .ok_or_else(|| E::custom("a number JSON cannot hold"))
            }
            fn visit_str<E>(self, s: &str) -> Result<Json, E> {
                Ok(Json::String(s.to_string()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Json::Array(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    entries.push(entry);
                }
                Ok(Json::Object(entries))
            }
        }
        d.deserialize_any(V)
    }
}

fn is_enum(schema: &Json) -> bool {
    schema
        .get("enum")
        .and_then(Json::as_array)
        .is_some_and(|a| !a.is_empty())
}

/// `default: ...` as harmony comments it: a string quoted unless the schema is an enum.
fn default_comment(schema: &Json) -> Option<String> {
    let default = schema.get("default")?;
    Some(match default.as_str() {
        Some(s) if is_enum(schema) => format!("default: {s}"),
        Some(s) => format!("default: \"{s}\""),
        None => format!("default: {default}"),
    })
}

/// `type` with ` | null` added when the schema is `nullable` and the type does not say so already.
fn with_null(ty: String, schema: &Json) -> String {
    if matches!(schema.get("nullable"), Some(Json::Bool(true))) && !ty.contains("null") {
        format!("{ty} | null")
    } else {
        ty
    }
}

/// The TypeScript-like type of `schema`, nested lines indented by `indent`.
pub(super) fn typescript(schema: &Json, indent: &str) -> String {
    if let Some(variants) = schema.get("oneOf").and_then(Json::as_array) {
        let mut out = String::new();
        for v in variants {
            out.push_str(&format!("\n{indent} | "));
            out.push_str(&with_null(typescript(v, &format!("{indent}   ")), v));
            let comments: Vec<String> = v
                .str_of("description")
                .map(String::from)
                .into_iter()
                .chain(default_comment(v))
                .collect();
            if !comments.is_empty() {
                out.push_str(&format!(" // {}", comments.join(" ")));
            }
        }
        return out;
    }
    if let Some(types) = schema.get("type").and_then(Json::as_array) {
        let names: Vec<&str> = types
            .iter()
            .filter_map(Json::as_str)
            .map(|t| if t == "integer" { "number" } else { t })
            .collect();
        if !names.is_empty() {
            return names.join(" | ");
        }
    }
    match schema.str_of("type") {
        Some("object") => object(schema, indent),
        Some("string") => {
            let values: Vec<String> = schema
                .get("enum")
                .and_then(Json::as_array)
                .unwrap_or_default()
                .iter()
                .filter_map(Json::as_str)
                .map(|s| format!("\"{s}\""))
                .collect();
            if values.is_empty() {
                "string".into()
            } else {
                values.join(" | ")
            }
        }
        Some("number" | "integer") => "number".into(),
        Some("boolean") => "boolean".into(),
        Some("array") => match schema.get("items") {
            Some(items) => format!("{}[]", typescript(items, indent)),
            None => "Array<any>".into(),
        },
        _ => "any".into(),
    }
}

/// `{`, one line per property (comments above it), `}`.
fn object(schema: &Json, indent: &str) -> String {
    let mut out = String::new();
    if let Some(desc) = schema.str_of("description") {
        out.push_str(&format!("{indent}// {desc}\n"));
    }
    out.push_str("{\n");
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Json::as_array)
        .unwrap_or_default()
        .iter()
        .filter_map(Json::as_str)
        .collect();
    let properties = match schema.get("properties") {
        Some(Json::Object(p)) => p.as_slice(),
        _ => &[],
    };
    for (key, prop) in properties {
        let optional = if required.contains(&key.as_str()) {
            ""
        } else {
            "?"
        };
        if let Some(title) = prop.str_of("title") {
            out.push_str(&format!("{indent}// {title}\n{indent}//\n"));
        }
        let variants = prop.get("oneOf").and_then(Json::as_array);
        if variants.is_none() {
            if let Some(desc) = prop.str_of("description") {
                out.push_str(&format!("{indent}// {desc}\n"));
            }
        }
        let examples = prop
            .get("examples")
            .and_then(Json::as_array)
            .unwrap_or_default();
        if !examples.is_empty() {
            out.push_str(&format!("{indent}// Examples:\n"));
            for ex in examples.iter().filter_map(Json::as_str) {
                out.push_str(&format!("{indent}// - \"{ex}\"\n"));
            }
        }
        match variants {
            Some(variants) => one_of_property(&mut out, key, optional, prop, variants, indent),
            None => {
                let ty = with_null(typescript(prop, &format!("{indent}    ")), prop);
                out.push_str(&format!("{indent}{key}{optional}: {ty},"));
                if let Some(c) = default_comment(prop) {
                    out.push_str(&format!(" // {c}"));
                }
                out.push('\n');
            }
        }
    }
    out.push_str(&format!("{indent}}}"));
    out
}

/// A property whose schema is a `oneOf`: its description (unless the first variant repeats it) and
/// default above it, then one ` | VARIANT // comments` line per variant.
fn one_of_property(
    out: &mut String,
    key: &str,
    optional: &str,
    prop: &Json,
    variants: &[Json],
    indent: &str,
) {
    let desc = prop.str_of("description");
    let repeated = desc.is_some() && variants.first().and_then(|v| v.str_of("description")) == desc;
    let desc_above = desc.filter(|_| !repeated);
    if let Some(d) = desc_above {
        out.push_str(&format!("{indent}// {d}\n"));
    }
    if let Some(c) = default_comment(prop) {
        out.push_str(&format!("{indent}// {c}\n"));
    }
    out.push_str(&format!("{indent}{key}{optional}:\n"));
    for (i, v) in variants.iter().enumerate() {
        let ty = with_null(typescript(v, &format!("{indent}   ")), v);
        out.push_str(&format!("{indent} | {ty}"));
        let mut comments = Vec::new();
        if !(i == 0 && desc_above.is_some()) {
            comments.extend(
                v.str_of("description")
                    .filter(|&d| Some(d) != desc)
                    .map(String::from),
            );
        }
        comments.extend(default_comment(v));
        if !comments.is_empty() {
            out.push_str(&format!(" // {}", comments.join(" ")));
        }
        out.push('\n');
    }
    out.push_str(&format!("{indent},\n"));
}
