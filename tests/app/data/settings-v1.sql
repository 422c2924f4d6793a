BEGIN TRANSACTION;
CREATE TABLE conversation_documents (
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            document_id INTEGER NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
            added_at REAL NOT NULL,
            position INTEGER NOT NULL,
            PRIMARY KEY (conversation_id, document_id)
        );
CREATE TABLE conversations (
            id INTEGER PRIMARY KEY,
            title TEXT NOT NULL,
            system_prompt TEXT NOT NULL,
            sampling TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            is_open INTEGER NOT NULL DEFAULT 1,
            tab_order INTEGER NOT NULL DEFAULT 0
        );
INSERT INTO "conversations" VALUES(1,'Kept chat','You are a helpful assistant.','{"temperature": 0.2, "top_p": 0.9, "max_new_tokens": 512}',1.79641618591652321807e+09,1.79641618591652321807e+09,1,0);
CREATE TABLE documents (
            id INTEGER PRIMARY KEY,
            path TEXT NOT NULL UNIQUE,
            name TEXT NOT NULL,
            kind TEXT NOT NULL,
            sha256 TEXT NOT NULL,
            mtime REAL NOT NULL,
            size INTEGER NOT NULL,
            num_chars INTEGER NOT NULL,
            added_at REAL NOT NULL
        );
CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            position INTEGER NOT NULL,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            prompt TEXT,
            status TEXT NOT NULL DEFAULT 'done',
            stats TEXT,
            sources TEXT,
            created_at REAL NOT NULL,
            UNIQUE (conversation_id, position)
        );
PRAGMA writable_schema=ON;
INSERT INTO sqlite_master(type,name,tbl_name,rootpage,sql)VALUES('table','messages_fts','messages_fts',0,'CREATE VIRTUAL TABLE "messages_fts" USING FTS5 (
    "content",
    tokenize=''porter'',
    content="messages"
)');
CREATE TABLE 'messages_fts_config'(k PRIMARY KEY, v) WITHOUT ROWID;
INSERT INTO "messages_fts_config" VALUES('version',4);
CREATE TABLE 'messages_fts_data'(id INTEGER PRIMARY KEY, block BLOB);
INSERT INTO "messages_fts_data" VALUES(1,X'');
INSERT INTO "messages_fts_data" VALUES(10,X'00000000000000');
CREATE TABLE 'messages_fts_docsize'(id INTEGER PRIMARY KEY, sz BLOB);
CREATE TABLE 'messages_fts_idx'(segid, term, pgno, PRIMARY KEY(segid, term)) WITHOUT ROWID;
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO "meta" VALUES('schema_version','1');
CREATE TABLE passages (
            id INTEGER PRIMARY KEY,
            document_id INTEGER NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
            seq INTEGER NOT NULL,
            text TEXT NOT NULL,
            page INTEGER,
            section TEXT,
            start INTEGER NOT NULL,
            "end" INTEGER NOT NULL,
            UNIQUE (document_id, seq)
        );
INSERT INTO sqlite_master(type,name,tbl_name,rootpage,sql)VALUES('table','passages_fts','passages_fts',0,'CREATE VIRTUAL TABLE "passages_fts" USING FTS5 (
    "text",
    tokenize=''porter'',
    content="passages"
)');
CREATE TABLE 'passages_fts_config'(k PRIMARY KEY, v) WITHOUT ROWID;
INSERT INTO "passages_fts_config" VALUES('version',4);
CREATE TABLE 'passages_fts_data'(id INTEGER PRIMARY KEY, block BLOB);
INSERT INTO "passages_fts_data" VALUES(1,X'');
INSERT INTO "passages_fts_data" VALUES(10,X'00000000000000');
CREATE TABLE 'passages_fts_docsize'(id INTEGER PRIMARY KEY, sz BLOB);
CREATE TABLE 'passages_fts_idx'(segid, term, pgno, PRIMARY KEY(segid, term)) WITHOUT ROWID;
CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO "settings" VALUES('model','{"weights": "int4", "source": "/models/qwen2.5-1.5b-instruct-q4_k_m.gguf", "reuse": "approx", "layer_streaming": true, "remote_cache": "redis://kv@127.0.0.1:6379/0"}');
INSERT INTO "settings" VALUES('recent_models','[{"weights": "int4", "source": "/models/qwen2.5-1.5b-instruct-q4_k_m.gguf", "reuse": "approx", "layer_streaming": true, "remote_cache": "redis://kv@127.0.0.1:6379/0"}, {"weights": "auto", "source": null, "reuse": "chunk", "layer_streaming": false, "remote_cache": null}, {"source": "/models/old.gguf", "reuse": "chunk", "awq_streaming": true}]');
INSERT INTO "settings" VALUES('remote','{"base_url": "http://127.0.0.1:8000/v1", "model": "smollm2", "active": false}');
INSERT INTO "settings" VALUES('api_server','{"enabled": true, "port": 8123}');
INSERT INTO "settings" VALUES('theme','"dark"');
CREATE INDEX conversation_documents_by_document ON conversation_documents (document_id);
CREATE TRIGGER "messages_ai" AFTER INSERT ON "messages" BEGIN
  INSERT INTO "messages_fts" (rowid, "content") VALUES (new.rowid, new."content");
END;
CREATE TRIGGER "messages_ad" AFTER DELETE ON "messages" BEGIN
  INSERT INTO "messages_fts" ("messages_fts", rowid, "content") VALUES('delete', old.rowid, old."content");
END;
CREATE TRIGGER "messages_au" AFTER UPDATE ON "messages" BEGIN
  INSERT INTO "messages_fts" ("messages_fts", rowid, "content") VALUES('delete', old.rowid, old."content");
  INSERT INTO "messages_fts" (rowid, "content") VALUES (new.rowid, new."content");
END;
CREATE TRIGGER "passages_ai" AFTER INSERT ON "passages" BEGIN
  INSERT INTO "passages_fts" (rowid, "text") VALUES (new.rowid, new."text");
END;
CREATE TRIGGER "passages_ad" AFTER DELETE ON "passages" BEGIN
  INSERT INTO "passages_fts" ("passages_fts", rowid, "text") VALUES('delete', old.rowid, old."text");
END;
CREATE TRIGGER "passages_au" AFTER UPDATE ON "passages" BEGIN
  INSERT INTO "passages_fts" ("passages_fts", rowid, "text") VALUES('delete', old.rowid, old."text");
  INSERT INTO "passages_fts" (rowid, "text") VALUES (new.rowid, new."text");
END;
PRAGMA writable_schema=OFF;
COMMIT;
